"""k2-optim: MuonClip (Muon + QK-Clip) for any PyTorch model, with batched Newton-Schulz."""

from .config import OptimConfig, WSDConfig
from .muon import Muon, adjust_lr, declare_fused, default_ns_dtype
from .newton_schulz import KELLER_QUINTIC, POLAR_EXPRESS, newton_schulz, resolve_ns_schedule
from .schedule import wsd_factor, wsd_schedule

__version__ = "0.1.0"

__all__ = [
    "KELLER_QUINTIC",
    "POLAR_EXPRESS",
    "Muon",
    "OptimConfig",
    "WSDConfig",
    "adjust_lr",
    "declare_fused",
    "default_ns_dtype",
    "newton_schulz",
    "resolve_ns_schedule",
    "wsd_factor",
    "wsd_schedule",
]

from .muonclip import MuonClip, muonclip_param_groups
from .qk_clip import QKClipLayer, QKClipSpan, apply_qk_clip, reduce_max_logits

__all__ += [
    "MuonClip",
    "QKClipLayer",
    "QKClipSpan",
    "apply_qk_clip",
    "muonclip_param_groups",
    "reduce_max_logits",
]
from .adapters import MHAQKClipAdapter, attach_qk_clip  # noqa: E402

__all__ += ["MHAQKClipAdapter", "attach_qk_clip"]
