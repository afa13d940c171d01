"""Hierarchical speculative decoding with draft models stacked over the database hierarchy.

    draft_models.py   draft models: self:blocks=K, self:int8, or any model with the target's tokenizer
    stack.py          the stack: each level verifies the batch of the level below (ModelStack)
    planner.py        the expected latency of a hierarchy, the latency-optimal one (DP), its
                      measured parameters, and plan files (`hd plan --out`)
    commands.py       `hd plan` as the CLI calls it: calibration, measuring, the choice saved
"""
