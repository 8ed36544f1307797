"""Everything about checkpoints: the formats (mcore dist-ckpt, HF files, legacy megatron, conversion) and a training
run's lifecycle (what a rank saves, the resume point, saving, committing, pruning). Import the submodules directly."""
