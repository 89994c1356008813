"""Simulation and pictures: the discrete-event simulator of one iteration, the adapter from a plan
to its stage costs, Chrome traces and Gantt charts.
"""
