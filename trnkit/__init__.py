"""trnkit: NKI kernels for AWS Trainium, a torch.library override registry, native Qwen3 and a trainer.

Data flows one way: harness -> qwen3 -> overrides -> kernels -> nkisim. Importing ``trnkit`` is cheap:
subpackages are imported on demand.
"""

__version__ = "0.1.0"
