"""DFlash core runtime: target wrappers, the drafter, the KV cache and the speculative engine.

No Triton imports here: the server translates tensors and calls this package.
"""
from .config import DFlashError, DrafterConfig, TargetConfig
from .drafter import DFlashDrafter, load_drafter, save_drafter
from .engine import SpeculativeEngine, StepOutput
from .sampling import SamplingParams
from .sequence import Sequence
from .target import TargetModel, load_target

__all__ = ["DFlashError", "DrafterConfig", "TargetConfig", "DFlashDrafter", "load_drafter", "save_drafter",
           "SpeculativeEngine", "StepOutput", "SamplingParams", "Sequence", "TargetModel", "load_target"]
