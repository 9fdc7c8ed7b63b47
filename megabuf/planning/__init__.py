"""Planning: the one planner (`build_plan`), `plan_model` from a module and a config,
and the replica checks and param markers the planner reads.
"""
