"""How a user's model reaches the rewrite: layer markers, layers from name scopes, the input_fn
contract, graph mode, and loading a user's model module for the command-line programs.
"""
