"""meshlm: train dense, hybrid Mamba-2/Transformer and MoE language models at any scale."""

from meshlm.errors import ConfigError
from meshlm.models.config import ModelConfig
from meshlm.models.language_model import LMOutput, LanguageModel

__version__ = "0.1.0"
__all__ = ["ModelConfig", "ConfigError", "LanguageModel", "LMOutput", "__version__"]
