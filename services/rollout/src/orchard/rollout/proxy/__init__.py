"""The capture proxy: OpenAI-compatible chat completions in front of an inference engine,
recording every call of every rollout with its exact tokens
(`orchard.rollout.capture.CallRecord`)."""
