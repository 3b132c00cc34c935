"""Slim torchtitan-style trainer for Qwen3 / Qwen3-MoE (``python -m trnkit.harness.train --config ...``).

- :mod:`.config`      dataclasses, TOML + ``--section.field value`` CLI, validation (:class:`ConfigError`)
- :mod:`.data`        local text -> tokenizer.json -> packed, shuffled, DP-sharded, resumable batches
- :mod:`.models`      the ``qwen3:<flavor>`` (native) and ``hf:<path>`` (transformers) backends, TP plans
- :mod:`.parallel`    process group / device mesh, FSDP2, DTensor-aware grad clipping
- :mod:`.tp_experts`  routed experts sharded on I under TP
- :mod:`.checkpoint`  atomic torch.distributed.checkpoint save / resume
- :mod:`.metrics`     FLOPs per token, peak FLOPs, torchtitan's console line, JSONL, loss plot
- :mod:`.train`       the loop (:func:`run`, :func:`main`)
"""
