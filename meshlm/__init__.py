"""meshlm: train dense, hybrid Mamba-2/Transformer and MoE language models at any scale."""

from meshlm.models.config import ConfigError, ModelConfig
from meshlm.models.language_model import LanguageModel, LMOutput

__version__ = "0.1.0"
__all__ = ["ModelConfig", "ConfigError", "LanguageModel", "LMOutput", "__version__"]
