"""Inference engines behind one interface (`orchard.rollout.engines.base.InferenceEngine`):
`local` (PyTorch on the CPU, the embedded default) and `vllm` (GPUs; an optional extra,
imported only when configured)."""
