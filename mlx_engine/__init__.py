"""mlx-engine: an embeddable inference engine for local models on MLX."""

# Must run before anything imports mlx.core (see loading/blas.py).
from .loading.blas import BlasStatus, blas_status, setup_blas

setup_blas()

from .api import (  # noqa: E402
    apply_chat_template,
    check_tools,
    create_generator,
    draft_name,
    is_draft_model_compatible,
    load_draft_model,
    load_model,
    memory_in_use,
    stop_generation,
    tokenize,
    unload,
    unload_draft_model,
)  # noqa: E402
from .decode.sampling import SamplingParams  # noqa: E402  (the sampling option group)
from .distributed import Follower, ShardedModelKit, load_sharded_model  # noqa: E402
from .draft.loading import DraftCompatibility  # noqa: E402
from .embeddings import (  # noqa: E402
    EmbeddingKit,
    Embeddings,
    embed,
    is_embedding_model,  # noqa: E402  (model discovery: an embedding model's folder)
    load_embedding_model,
)
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
from .heads.loading import OWN_MTP  # noqa: E402  (load_draft_model(kit, OWN_MTP): the target's own MTP head)
from .kits.drafts import check_draft_model  # noqa: E402
from .kits.text import ModelKit  # noqa: E402
from .kits.vision import VisionModelKit  # noqa: E402
from .loading import catalog  # noqa: E402  (models known by name: lookup, draft_for)
from .loading.catalog import CATALOG, DEFAULT_MODEL  # noqa: E402
from .loading.gguf.reader import find_gguf, is_gguf  # noqa: E402  (model discovery: GGUF files)
from .loading.memory import physical_memory  # noqa: E402  (the machine's memory, for a host's budget)
from .request.options import (  # noqa: E402  (create_generator's options, by group; its arguments and defaults)
    DECODING_CHOICES,
    ConstraintOptions,
    Decoding,
    DecodingOptions,
    GenerationOptions,
    HandlingOptions,
    OutputOptions,
    RequestOptions,
)
from .request.validate import context_budget  # noqa: E402
from .results import (  # noqa: E402
    GenerationResult,
    GenerationStats,
    GenerationStopCondition,
    Token,
    ToolCall,
    ToolCallDelta,
    TopLogprob,
)
from .tools.spec import MAX_JSON_DEPTH, json_depth  # noqa: E402  (the one JSON nesting limit)

__all__ = [
    "CATALOG",
    "MAX_JSON_DEPTH",
    "find_gguf",
    "is_embedding_model",
    "is_gguf",
    "json_depth",
    "physical_memory",
    "catalog",
    "DEFAULT_MODEL",
    "apply_chat_template",
    "check_tools",
    "context_budget",
    "GenerationOptions",
    "RequestOptions",
    "SamplingParams",
    "DecodingOptions",
    "ConstraintOptions",
    "OutputOptions",
    "HandlingOptions",
    "DECODING_CHOICES",
    "Decoding",
    "BlasStatus",
    "CallbackError",
    "ChatTemplateLimitError",
    "DistributedConfigError",
    "DraftCompatibility",
    "EmbeddingKit",
    "Embeddings",
    "embed",
    "load_embedding_model",
    "OWN_MTP",
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
    "draft_name",
    "memory_in_use",
    "stop_generation",
    "tokenize",
    "unload",
    "unload_draft_model",
]
