"""Orchard's language-model pieces shared by the trainer and the inference engines.

- `orchard.lm.tokenizer`: the offline byte-level BPE tokenizer, built in code.
- `orchard.lm.chat`: the chat template with tool calls, the renderer and the parser.
- `orchard.lm.vision`: the chat format with screenshots for vision-language models.
- `orchard.lm.models`: small causal LMs built from a config in code.
- `orchard.lm.model_folder`: model folders (weights, config, tokenizer) in Hugging Face format.
- `orchard.lm.weights`: the weight-version registry in etcd.

Modules are imported one by one (`from orchard.lm.chat import ChatRenderer`), so that reading the
registry does not import torch.
"""
