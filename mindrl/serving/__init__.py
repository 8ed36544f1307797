"""Remote rollout: an HTTP server around `VllmEngine` (generation + versioned weight updates) and its wire
protocol; the trainer-side client lives in `mindrl.serving.client`."""
