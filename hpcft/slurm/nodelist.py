"""Slurm hostlist expansion and compression in pure Python (no scontrol, no controller needed)."""
import re

from hpcft.errors import ConfigError

_TAIL_DIGITS = re.compile(r"^(.*?)(\d+)$")


def _split_top(text: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ConfigError(f"invalid hostlist {text!r}: nested '['")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ConfigError(f"invalid hostlist {text!r}: ']' without '['")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ConfigError(f"invalid hostlist {text!r}: '[' without ']'")
    parts.append(text[start:])
    return [p for p in (p.strip() for p in parts) if p]


def expand_range(spec: str, pattern: str) -> list[str]:
    """A range list's numbers ('1-4,7', '001-016') padded as the lower bound; `pattern`: the whole text, for errors."""
    out: list[str] = []
    for piece in spec.split(","):
        lo, sep, hi = piece.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ConfigError(f"invalid hostlist {pattern!r}: bad range {piece!r} (want e.g. [1-4,7] or [001-016])")
        if not sep:
            out.append(lo)
            continue
        first, last = int(lo), int(hi)
        if last < first:
            raise ConfigError(f"invalid hostlist {pattern!r}: range {piece!r} runs backwards")
        # Zero padding follows the lower bound, as in Slurm: [001-3] -> 001 002 003; [1-003] -> 1 2 3.
        out.extend(str(n).zfill(len(lo)) for n in range(first, last + 1))
    return out


def _expand_one(item: str) -> list[str]:
    # Slurm's order for several brackets: the last one varies fastest, the first next, then the ones
    # between from left to right (a[1-2]b[1-2]c[1-2] -> a1b1c1 a1b1c2 a2b1c1 a2b1c2 a1b2c1 ...).
    tokens = re.findall(r"([^\[\]]*)(?:\[([^\]]*)\])?", item)
    groups = [(lit, expand_range(spec, item)) for lit, spec in tokens if spec]
    tail = "".join(lit for lit, spec in tokens if not spec)
    if not groups:
        return [tail]

    def ranges(k: int) -> list[tuple[str, list[str]]]:
        lit, values = groups[k]
        if k == len(groups) - 1:
            return [(lit, values)]
        return [(lit + v + prefix, rng) for prefix, rng in ranges(k + 1) for v in values]

    return [prefix + v for prefix, rng in ranges(0) for v in rng]


def expand(hostlist: str) -> list[str]:
    """`n[1-3],gpu[01-02]` -> ['n1','n2','n3','gpu01','gpu02'] in Slurm's order (duplicates kept)."""
    hosts: list[str] = []
    for item in _split_top(hostlist or ""):
        if "]" in item and item.rsplit("]", 1)[1]:
            # Slurm 22.05 rejects text after the last bracket ("n[1-3]-ib"); so do we, to agree with it.
            raise ConfigError(f"invalid hostlist {hostlist!r}: text after ']' in {item!r} is not accepted by Slurm")
        hosts.extend(_expand_one(item))
    return hosts


def _format_group(prefix: str, numbers: list[str]) -> str:
    runs: list[tuple[str, str]] = []
    for num in numbers:
        if runs:
            lo, hi = runs[-1]
            if int(num) == int(hi) + 1 and str(int(num)).zfill(len(lo)) == num:
                runs[-1] = (lo, num)
                continue
        runs.append((num, num))
    if len(runs) == 1 and runs[0][0] == runs[0][1]:
        return prefix + runs[0][0]
    body = ",".join(lo if lo == hi else f"{lo}-{hi}" for lo, hi in runs)
    return f"{prefix}[{body}]"


def compress(hosts: list[str]) -> str:
    """Inverse of expand, order kept as `scontrol show hostlist` does: consecutive names sharing a prefix merge."""
    groups: list[tuple[str | None, list[str]]] = []
    for host in hosts:
        m = _TAIL_DIGITS.match(host)
        prefix, num = (m.group(1), m.group(2)) if m else (None, host)
        if prefix is not None and groups and groups[-1][0] == prefix:
            groups[-1][1].append(num)
        else:
            groups.append((prefix, [num]))
    return ",".join(num[0] if prefix is None else _format_group(prefix, num) for prefix, num in groups)
