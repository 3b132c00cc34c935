"""Slim torchtitan-style trainer for Qwen3 / Qwen3-MoE (``python -m trnkit.harness.train --config ...``).

- :mod:`.config`      dataclasses, TOML + ``--section.field value`` CLI, validation (:class:`ConfigError`)
- :mod:`.data`        local text -> tokenizer.json -> packed, shuffled, DP-sharded, resumable batches
- :mod:`.models`      ``model.spec`` -> a :class:`trnkit.model_spec.ModelSpec` (the table of model families)
- :mod:`.hf_spec`     transformers v5 models as a ModelSpec (``hf:<path>``)
- :mod:`.parallel`    process group / device mesh, FSDP2, DTensor-aware grad clipping
- :mod:`.checkpoint`  atomic torch.distributed.checkpoint save / resume
- :mod:`.metrics`     FLOPs per token, peak FLOPs, torchtitan's console line, JSONL, loss plot
- :mod:`.train`       the :class:`Trainer` (build, ``train_step``, ``train``), :func:`run`, :func:`main`
"""
