"""mlx-engine: an embeddable inference engine for local models on MLX."""

# Must run before anything imports mlx.core (see _blas.py).
from ._blas import BlasStatus, blas_status, setup_blas

setup_blas()

from .catalog import CATALOG, DEFAULT_MODEL  # noqa: E402
from .distributed import Follower, ShardedModelKit, load_sharded_model  # noqa: E402
from .errors import (  # noqa: E402
    CallbackError,
    ChatTemplateLimitError,
    DistributedConfigError,
    GenerationInProgressError,
    IncompatibleDraftModelError,
    InvalidArgument,
    ModelLoadError,
    ShardedKitError,
)  # noqa: E402
from .generate import (  # noqa: E402
    apply_chat_template,
    create_generator,
    is_draft_model_compatible,
    load_draft_model,
    load_model,
    stop_generation,
    tokenize,
    unload,
    unload_draft_model,
)
from .model_kit import ModelKit  # noqa: E402
from .results import (  # noqa: E402
    GenerationResult,
    GenerationStats,
    GenerationStopCondition,
    Token,
    ToolCall,
    ToolCallDelta,
    TopLogprob,
)
from .speculative.draft_loading import DraftCompatibility, check_draft_model  # noqa: E402
from .vision_model_kit import VisionModelKit  # noqa: E402

__all__ = [
    "CATALOG",
    "DEFAULT_MODEL",
    "apply_chat_template",
    "BlasStatus",
    "CallbackError",
    "ChatTemplateLimitError",
    "DistributedConfigError",
    "DraftCompatibility",
    "Follower",
    "GenerationInProgressError",
    "GenerationResult",
    "GenerationStats",
    "GenerationStopCondition",
    "IncompatibleDraftModelError",
    "InvalidArgument",
    "ModelKit",
    "ModelLoadError",
    "ShardedKitError",
    "ShardedModelKit",
    "Token",
    "ToolCall",
    "ToolCallDelta",
    "TopLogprob",
    "VisionModelKit",
    "blas_status",
    "check_draft_model",
    "create_generator",
    "is_draft_model_compatible",
    "load_draft_model",
    "load_model",
    "load_sharded_model",
    "stop_generation",
    "tokenize",
    "unload",
    "unload_draft_model",
]
