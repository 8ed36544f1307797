"""Module-level functions the resharding tests run on pool ranks."""

from __future__ import annotations

import torch


def stream_checkpoint(load_dir: str, tp: int, pp: int, bucket_size_mb: float) -> dict:
    """Load the checkpoint at TP x PP, stream it, return {hf_name: tensor copy} and the stream's stats."""
    from mindrl.checkpoint.convert import _load_rank
    from mindrl.resharding import WeightStreamer

    spec, _, model = _load_rank(load_dir, tp, pp, None)
    streamer = WeightStreamer(model, spec, bucket_size_mb)
    out = {}
    for name, tensor in streamer.stream():
        assert name not in out, f"{name} emitted twice"
        out[name] = tensor.clone()
    return {"tensors": out, "order": list(out), "stats": streamer.stats}
