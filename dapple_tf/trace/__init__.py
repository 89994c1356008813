"""The measured timeline of a step: RunMetadata step stats in the simulator's terms, and a hook that
writes it.
"""
