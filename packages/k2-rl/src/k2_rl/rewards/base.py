"""The reward interface, the reward registry and budget control.

A reward scores one sampled response: ``reward(prompt, response, task) -> float``, where
``task`` is the task's metadata (its reference answer, unit tests, constraints, ...). Rewards
are plain floats, usually in [0, 1] (the K1.5 objective centres them per prompt, so only
differences inside a prompt's group matter).

Anything with that call signature is a reward (:class:`Reward` is a structural protocol);
:class:`BaseReward` is a small convenience base class that adds a ``name``. Rewards are
registered under a name with :func:`register_reward` and looked up with :func:`get_reward`.
Names are what the RL config and :class:`~k2_rl.rewards.pool.RewardPool` pass around: a worker
process resolves the name itself, so the reward object never has to be pickled.

:func:`get_reward` also accepts two import specs, so a reward can live outside this package
without registering anything:

* ``"package.module:attr"`` imports ``package.module`` and takes ``attr``;
* ``"/path/to/file.py:attr"`` loads that file as a module and takes ``attr``.

A registered or imported class is instantiated with no arguments; a function or an instance is
returned as it is.

A *group* reward (:class:`GroupReward`, ``group = True``; the built-in ``rubric``) scores all K
responses of a prompt together instead; :func:`is_group_reward` tells the RL loop which kind a
name is.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, TypeVar, runtime_checkable

__all__ = [
    "BaseReward",
    "GroupReward",
    "Reward",
    "RewardFn",
    "budget_penalty",
    "get_reward",
    "is_group_reward",
    "list_rewards",
    "lookup_reward",
    "register_reward",
]

RewardFn = Callable[[str, str, dict], float]
"""A reward as a plain function: ``fn(prompt, response, task) -> float``."""

T = TypeVar("T")


@runtime_checkable
class Reward(Protocol):
    """What every reward implements (structurally; subclassing is optional)."""

    name: str

    def __call__(self, prompt: str, response: str, task: dict) -> float:
        """Score ``response`` to ``prompt``; ``task`` holds the task's metadata."""
        ...


class BaseReward:
    """A convenience base class: set ``name`` and implement :meth:`__call__`.

    Subclasses should stay picklable (plain attributes) so that an instance can also be
    sent to worker processes directly instead of by registry name.
    """

    name: str = "reward"
    # the task fields the reward reads, checked when tasks are loaded (file:line on a missing one)
    task_fields: tuple[str, ...] = ("answer",)

    def __call__(self, prompt: str, response: str, task: dict) -> float:
        raise NotImplementedError(f"{type(self).__name__} must implement __call__(prompt, response, task)")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


class GroupReward:
    """A reward that scores all K responses of a prompt at once (``group = True``), e.g. the
    self-critique rubric reward, which compares them pairwise. The RL loop calls
    ``score_groups([(messages, responses, task), ...], seed=...)`` in its own process (not in the
    reward pool) and reads ``.rewards`` (one list per group) and ``.stats``; a class may provide
    ``from_config(cfg, critic)`` to be built from the run's config."""

    name: str = "group"
    group: bool = True
    task_fields: tuple[str, ...] = ()  # scored against rubrics, not a reference answer
    needs_critic: bool = False  # the loop builds its critic (--critic-url) and passes it to from_config

    def score_groups(self, groups: Any, *, seed: int = 0) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must implement score_groups(groups, seed=...)")

    def __call__(self, prompt: str, response: str, task: dict) -> float:
        raise TypeError(
            f"reward {self.name!r} scores a prompt's responses together (a group reward): "
            "call score_groups, or let the RL loop do it"
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


_REGISTRY: dict[str, Any] = {}

# Built-in rewards register themselves when their module is imported; get_reward imports the
# module on first use so that a fresh worker process finds them by name alone.
_BUILTIN_MODULES: dict[str, str] = {
    "math": "k2_rl.rewards.math",
    "instruction": "k2_rl.rewards.instruction",
    "code": "k2_rl.rewards.code",
    "rubric": "k2_rl.rewards.rubric",
}


def _qualified(obj: Any) -> tuple[str, str]:
    return getattr(obj, "__module__", ""), getattr(obj, "__qualname__", type(obj).__qualname__)


def register_reward(name: str, *, override: bool = False) -> Callable[[T], T]:
    """Decorator registering a reward class, function or instance under ``name``.

    Registering the same name twice raises ``ValueError`` unless ``override=True`` or the new
    object has the same qualified name as the old one (a module imported a second time, e.g.
    in a worker process). A registered class gets ``name`` as its ``name`` attribute when it
    did not set one of its own.
    """
    if not isinstance(name, str) or not name or ":" in name:
        raise ValueError(f"register_reward: name must be a non-empty string without ':', got {name!r}")

    def decorator(obj: T) -> T:
        if not callable(obj):
            raise TypeError(
                f"register_reward({name!r}): expected a callable reward, got {type(obj).__name__}"
            )
        old = _REGISTRY.get(name)
        if old is not None and not override and _qualified(old)[1] != _qualified(obj)[1]:
            raise ValueError(
                f"register_reward: a reward named {name!r} is already registered ({old!r}); pass override=True"
            )
        if isinstance(obj, type) and obj.__dict__.get("name") is None:
            obj.name = name  # type: ignore[attr-defined]
        _REGISTRY[name] = obj
        return obj

    return decorator


def _load_spec(spec: str) -> Any:
    target, _, attr = spec.rpartition(":")
    if not target or not attr:
        raise ValueError(f"reward spec {spec!r}: expected 'module:attr' or 'path/to/file.py:attr'")
    if target.endswith(".py"):
        path = Path(target).resolve()
        if not path.is_file():
            raise ValueError(f"reward spec {spec!r}: file {path} does not exist")
        mod_name = f"_k2_reward_file_{abs(hash(str(path)))}"
        module = sys.modules.get(mod_name)
        if module is None:
            file_spec = importlib.util.spec_from_file_location(mod_name, path)
            assert file_spec is not None and file_spec.loader is not None
            module = importlib.util.module_from_spec(file_spec)
            sys.modules[mod_name] = module
            file_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(target)
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(f"reward spec {spec!r}: {target} has no attribute {attr!r}") from None


def get_reward(name: str) -> Any:
    """Return the reward registered as ``name`` (or named by an import spec, see module doc).

    Classes are instantiated with no arguments. Raises ``KeyError`` naming the known rewards
    when ``name`` is unknown.
    """
    if ":" in name:
        obj = _load_spec(name)
    else:
        if name not in _REGISTRY and name in _BUILTIN_MODULES:
            importlib.import_module(_BUILTIN_MODULES[name])
        if name not in _REGISTRY:
            raise UnknownRewardError(name)
        obj = _REGISTRY[name]
    if isinstance(obj, type):
        obj = obj()
    if not callable(obj):
        raise TypeError(f"reward {name!r} is not callable: {obj!r}")
    return obj


def lookup_reward(name: str) -> Any:
    """What ``name`` is registered as (or names by an import spec), not instantiated."""
    if ":" in name:
        return _load_spec(name)
    if name not in _REGISTRY and name in _BUILTIN_MODULES:
        importlib.import_module(_BUILTIN_MODULES[name])
    if name not in _REGISTRY:
        raise UnknownRewardError(name)
    return _REGISTRY[name]


class UnknownRewardError(KeyError, ValueError):
    """A reward name nobody registered: a KeyError for lookups, a ValueError for the CLI's
    one-line error; the message names the known rewards."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name

    def __str__(self) -> str:
        return f"unknown reward {self.name!r}; registered rewards: {', '.join(known_rewards())}"


def known_rewards() -> list[str]:
    """Names `get_reward` accepts without an import spec (registered or built in)."""
    return sorted(set(_REGISTRY) | set(_BUILTIN_MODULES))


def reward_known(name: str) -> bool:
    """Whether `name` is a registered or built-in reward, or an import spec (checked when loaded)."""
    return ":" in name or name in _REGISTRY or name in _BUILTIN_MODULES


def is_group_reward(name: str) -> bool:
    """Whether the reward ``name`` scores a prompt's responses together (``group = True``)."""
    return bool(getattr(lookup_reward(name), "group", False))


def task_fields(name: str) -> tuple[str, ...]:
    """The task fields reward ``name`` reads besides ``messages``: its ``task_fields`` attribute;
    ``("answer",)`` for a plain function (a reference answer, as math's), ``()`` for a group reward."""
    obj = lookup_reward(name)
    default: tuple[str, ...] = () if getattr(obj, "group", False) else ("answer",)
    return tuple(getattr(obj, "task_fields", default))


def list_rewards() -> list[str]:
    """Names of the registered rewards (built-ins included)."""
    return sorted(set(_REGISTRY) | set(_BUILTIN_MODULES))


def budget_penalty(reward: float, truncated: bool, penalty: float = 0.5, *, replace: bool = False) -> float:
    """Budget control: penalise a response that ran past its task's token budget.

    A response longer than the per-task maximum length is truncated by the sampler; its reward
    becomes ``reward - penalty`` (or exactly ``-penalty`` with ``replace=True``, which ignores
    whatever the truncated text happened to score). A response within budget keeps its reward.
    Because the K1.5 objective centres rewards per prompt, the penalty pushes the policy towards
    answers that fit the budget relative to its other samples for the same prompt.
    """
    if penalty < 0:
        raise ValueError(f"budget_penalty: penalty must be >= 0, got {penalty}")
    if not truncated:
        return float(reward)
    return -float(penalty) if replace else float(reward) - float(penalty)
