"""Workers: the state-holding side (models, optimizers, engines) of the driver -> workers -> engines flow.

`hybrid_engine.HybridEngine` is the in-process core of the integrated worker (actor + rollout engine);
the Ray actor wrappers and placement groups come with the trainer.
"""
