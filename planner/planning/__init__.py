"""Planning: the DAPPLE planner's search, its cost and memory models, the baselines, plan
evaluation, the choice of schedule, and the planners' front door (api.py).
"""
