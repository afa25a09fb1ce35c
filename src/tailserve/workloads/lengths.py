"""Token-length distributions for synthetic prompts and outputs.

Each distribution is a frozen dataclass with ``sample(n, rng)`` returning ``n`` integer token
counts, all >= 1 (a request needs at least one prompt token and one output token). The random
generator is passed in, never owned, so one workload can draw every length from its own seeded
stream. ``parse_length`` reads the ``--input-len`` / ``--output-len`` command-line forms.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np

LENGTH_FORMS = (
    "N",
    "fixed:N",
    "uniform:LOW:HIGH",
    "lognormal:mean=M,sigma=S[,max=N]",
)


class LengthDist(Protocol):
    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """``n`` token counts (int64, each >= 1)."""
        ...


def _check_n(n: int) -> None:
    if n < 0:
        raise ValueError(f"number of samples must be >= 0, got {n}")


@dataclass(frozen=True)
class Fixed:
    value: int  # tokens

    def __post_init__(self) -> None:
        if self.value < 1:
            raise ValueError(f"fixed length must be >= 1 token, got {self.value}")

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        _check_n(n)
        return np.full(n, self.value, dtype=np.int64)


@dataclass(frozen=True)
class Uniform:
    low: int  # tokens, inclusive
    high: int  # tokens, inclusive

    def __post_init__(self) -> None:
        if self.low < 1:
            raise ValueError(f"uniform low must be >= 1 token, got {self.low}")
        if self.high < self.low:
            raise ValueError(f"uniform high must be >= low ({self.low}), got {self.high}")

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        _check_n(n)
        return rng.integers(self.low, self.high, size=n, endpoint=True, dtype=np.int64)


@dataclass(frozen=True)
class LogNormal:
    """Log-normal lengths given by their mean in tokens, as people quote them ("mean 512").

    ``sigma`` is the standard deviation of the underlying normal; the normal's mean is derived as
    ln(mean) - sigma^2 / 2 so the unclipped distribution has exactly the requested mean. Samples
    are rounded and clipped to [1, max_value], which lowers the realised mean slightly when the
    cap bites.
    """

    mean: float  # tokens
    sigma: float
    max_value: int | None = None  # tokens; None for no cap

    def __post_init__(self) -> None:
        if not (self.mean > 0 and math.isfinite(self.mean)):
            raise ValueError(f"lognormal mean must be a finite number > 0, got {self.mean}")
        if not (self.sigma >= 0 and math.isfinite(self.sigma)):
            raise ValueError(f"lognormal sigma must be a finite number >= 0, got {self.sigma}")
        if self.max_value is not None and self.max_value < 1:
            raise ValueError(f"lognormal max must be >= 1 token, got {self.max_value}")

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        _check_n(n)
        mu = math.log(self.mean) - self.sigma**2 / 2
        values = np.rint(rng.lognormal(mu, self.sigma, size=n))
        upper = self.max_value if self.max_value is not None else np.iinfo(np.int64).max
        return np.clip(values, 1, upper).astype(np.int64)


@dataclass(frozen=True)
class Empirical:
    """Resample (with replacement) from observed lengths, e.g. a trace's prompt lengths."""

    values: tuple[int, ...]  # tokens; any sequence is accepted and stored as a tuple

    def __post_init__(self) -> None:
        # Store a tuple so the dataclass stays hashable and immutable whatever the caller passed.
        object.__setattr__(self, "values", tuple(int(v) for v in self.values))
        if not self.values:
            raise ValueError("empirical distribution needs at least one value, got none")
        smallest = min(self.values)
        if smallest < 1:
            raise ValueError(f"empirical lengths must all be >= 1 token, got {smallest}")

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        _check_n(n)
        return rng.choice(np.asarray(self.values, dtype=np.int64), size=n, replace=True)


class _LengthSyntaxError(ValueError):
    """Already names the accepted forms, so ``parse_length`` re-raises it unwrapped."""


def _bad_length(text: str, why: str = "") -> ValueError:
    detail = f" ({why})" if why else ""
    return _LengthSyntaxError(
        f"bad length distribution {text!r}{detail}; accepted forms: {', '.join(LENGTH_FORMS)}"
    )


def _parse_int(field: str, whole: str) -> int:
    try:
        return int(field)
    except ValueError:
        raise _bad_length(whole, f"{field!r} is not an integer") from None


def parse_length(text: str) -> Fixed | Uniform | LogNormal:
    """Parse ``512``, ``fixed:512``, ``uniform:128:1024`` or
    ``lognormal:mean=512,sigma=0.8[,max=4096]``; raise ValueError listing these otherwise."""
    spec = text.strip()
    name, _, rest = spec.partition(":")
    name = name.lower()
    try:
        if name.isdigit() and not rest:
            return Fixed(int(name))
        if name == "fixed":
            return Fixed(_parse_int(rest, text))
        if name == "uniform":
            parts = rest.split(":")
            if len(parts) != 2:
                raise _bad_length(text, "uniform takes LOW:HIGH")
            return Uniform(_parse_int(parts[0], text), _parse_int(parts[1], text))
        if name == "lognormal":
            return _parse_lognormal(rest, text)
    except _LengthSyntaxError:
        raise
    except ValueError as error:  # a constructor rejected a value, e.g. fixed:0
        raise _bad_length(text, str(error)) from None
    raise _bad_length(text)


def _parse_lognormal(rest: str, text: str) -> LogNormal:
    params: dict[str, str] = {}
    for item in rest.split(","):
        key, eq, value = item.partition("=")
        key = key.strip().lower()
        if not eq or key not in ("mean", "sigma", "max") or key in params:
            raise _bad_length(text, f"unexpected {item!r}")
        params[key] = value.strip()
    if "mean" not in params or "sigma" not in params:
        raise _bad_length(text, "lognormal needs mean= and sigma=")
    try:
        mean = float(params["mean"])
        sigma = float(params["sigma"])
    except ValueError:
        raise _bad_length(text, "mean and sigma must be numbers") from None
    max_value = _parse_int(params["max"], text) if "max" in params else None
    return LogNormal(mean, sigma, max_value)
