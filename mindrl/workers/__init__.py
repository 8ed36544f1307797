"""Workers: the state-holding side (models, optimizers, engines) of the driver -> workers -> engines flow."""
