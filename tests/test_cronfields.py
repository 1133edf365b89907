"""Cron fields to OnCalendar=: a conversion table checked against systemd-analyze calendar and cronsim.

tests/cron_cases.txt holds every case as data: the cron fields, the specs the
converter gives, and the next elapses `systemd-analyze calendar` computed for
those specs. The test checks each line of that table three ways: the
converter still gives the specs; systemd still computes the times; cronsim, an
evaluator that copies Debian cron's rules (the day-of-month/day-of-week OR and
its `*` exception included), fires at the same times; and the `oncalendar`
package the runner computes occurrences with agrees. `--update-golden`
rewrites the table from the converter and systemd (cronsim must still agree).
"""

from __future__ import annotations

import random
import re
import subprocess
from datetime import datetime, timezone
from pathlib import Path

import oncalendar
import pytest
from cronsim import CronSim

from consulrun.manifest.cronfields import CronError, MACROS, looks_like_cron, to_oncalendar
from tests.conftest import require_tool

CASES = Path(__file__).parent / "cron_cases.txt"
# Just before midnight at the end of a month and of a year: the rollovers where calendar arithmetic goes wrong.
BASES = [datetime(2026, 2, 27, 23, 58, tzinfo=timezone.utc), datetime(2026, 12, 31, 23, 53, tzinfo=timezone.utc)]
ITERATIONS = 6
HEADER = f"""\
# Cron fields -> OnCalendar= specs, with the next {ITERATIONS} elapses after each base time (UTC) that
# `systemd-analyze calendar` gives for the specs (the union, when day-of-month OR day-of-week needs two).
# Checked by tests/test_cronfields.py against systemd-analyze, cronsim and oncalendar;
# `pytest tests/test_cronfields.py --update-golden` rewrites it (hand-picked cases, then a seeded random set).
"""

HAND_PICKED = [
    "* * * * *", "*/15 * * * *", "0 * * * *", "0 2 * * *", "30 4 * * *", "0 */2 * * *", "15,45 * * * *",
    "0 9-17 * * 1-5", "0 9-17 * * mon-fri", "0 0 * * 0", "0 0 * * 7", "0 0 * * sun", "0 0 * * SAT,SUN",
    "0 0 1 * *", "0 0 1 1 *", "0 0 1 jan,jul *", "0 0 1 */3 *", "0 0 15 feb-apr *", "0 0 29 2 *", "0 0 31 * *",
    "30 4 1,15 * 5", "0 0 13 * fri", "0 0 1-7 * 1", "0 0 */2 * 1", "0 0 1 * */2", "0 0 1-31 * 1", "0 0 * * 0-6",
    "5/10 * * * *", "0-30/10 * * * *", "10-50/20 3 * * *", "0 0 * * 5-7", "0 0 * * 0,3,6", "0 12 * * 1-7",
    "59 23 31 12 *", "0 0 1,15,28 * 1-5", "0 22 * * 1-5", "*/5 9-17 * * mon-fri", "0 0 L * *",
    *sorted(MACROS), "@reboot",
]


def _field(rng: random.Random, low: int, high: int, names: list[str] | None) -> str:
    def one() -> str:
        a = rng.randint(low, high)
        b = rng.randint(a, high)
        kind = rng.choice(["n", "range", "range-step", "start-step", "name"] if names else
                          ["n", "range", "range-step", "start-step"])
        if kind == "range":
            return f"{a}-{b}"
        if kind == "range-step" and b > a:  # cronsim reads a one-value range with a step (5-5/2) as 5/2; cron does not
            return f"{a}-{b}/{rng.randint(1, b - a)}"
        if kind == "start-step":
            return f"{a}/{rng.randint(1, max(1, (high - a) or 1))}"
        if kind == "name" and names:
            return rng.choice(names) if rng.random() < 0.6 else "-".join(sorted(rng.sample(names, 2), key=names.index))
        return str(a)

    shape = rng.random()
    if shape < 0.3:
        return "*"
    if shape < 0.45:
        return f"*/{rng.randint(1, (high - low) // 2 or 1)}"
    if shape < 0.75:
        return one()
    return ",".join(one() for _ in range(rng.randint(2, 3)))


def generated(count: int = 200, seed: int = 14) -> list[str]:
    rng = random.Random(seed)
    months = ["jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"]
    days = ["sun", "mon", "tue", "wed", "thu", "fri", "sat"]
    out: list[str] = []
    while len(out) < count:
        fields = " ".join([_field(rng, 0, 59, None), _field(rng, 0, 23, None), _field(rng, 1, 28, None),
                           _field(rng, 1, 12, months), _field(rng, 0, 7, days)])
        if fields not in out and fields not in HAND_PICKED:
            out.append(fields)
    return out


def _key(base: datetime) -> str:
    return f"next after {base:%Y-%m-%dT%H:%M}"


def systemd_elapses(specs: list[str], base: datetime) -> dict[str, list[str]]:
    """Next elapses of each spec, from one `systemd-analyze calendar` run in UTC."""
    result = subprocess.run(["systemd-analyze", "calendar", f"--iterations={ITERATIONS}",
                             f"--base-time={base:%Y-%m-%d %H:%M:%S} UTC", *specs],
                            capture_output=True, text=True, env={"TZ": "UTC", "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr
    blocks = re.split(r"\n\s*\n", result.stdout.strip())
    assert len(blocks) == len(specs), result.stdout
    times: dict[str, list[str]] = {}
    for spec, block in zip(specs, blocks):
        found = re.findall(r"(?:Next elapse|Iter\. #\d+): \w{3} (\d{4}-\d\d-\d\d \d\d:\d\d):00 UTC", block)
        times[spec] = [t.replace(" ", "T") for t in found]
    return times


def merged(per_spec: dict[str, list[str]], specs: list[str]) -> list[str]:
    return sorted({t for spec in specs for t in per_spec[spec]})[:ITERATIONS]


def load_cases() -> list[dict[str, object]]:
    cases = []
    for block in re.split(r"\n\s*\n", CASES.read_text().split("\n\n", 1)[1].strip()):
        case: dict[str, object] = {"spec": []}
        for line in block.splitlines():
            key, _, value = line.partition(": ")
            if key == "spec":
                case["spec"].append(value)  # type: ignore[union-attr]
            else:
                case[key] = value
        cases.append(case)
    return cases


def write_cases() -> None:
    rows = []
    for fields in HAND_PICKED + generated():
        try:
            rows.append((fields, to_oncalendar(fields), None))
        except CronError as exc:
            rows.append((fields, [], str(exc)))
    all_specs = sorted({s for _, specs, _ in rows for s in specs})
    per_base = {base: systemd_elapses(all_specs, base) for base in BASES}
    out = [HEADER]
    for fields, specs, error in rows:
        lines = [f"cron: {fields}"]
        if error:
            lines.append(f"error: {error}")
        else:
            lines += [f"spec: {s}" for s in specs]
            lines += [f"{_key(base)}: " + " ".join(merged(per_base[base], specs)) for base in BASES]
        out.append("\n".join(lines) + "\n")
    CASES.write_text("\n".join(out))


def cronsim_elapses(fields: str, base: datetime) -> list[str]:
    expr = MACROS.get(fields, fields)
    it = CronSim(expr, base)
    return [next(it).strftime("%Y-%m-%dT%H:%M") for _ in range(ITERATIONS)]


def oncalendar_elapses(specs: list[str], base: datetime) -> list[str]:
    it = oncalendar.OnCalendar("\n".join(specs), base)
    return [next(it).astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M") for _ in range(ITERATIONS)]


@pytest.mark.systemd
def test_conversion_table(request: pytest.FixtureRequest) -> None:
    require_tool("systemd-analyze")
    if request.config.getoption("--update-golden"):
        write_cases()
    cases = load_cases()
    assert len(cases) >= 240
    converted = [c for c in cases if c["spec"]]
    all_specs = sorted({s for c in converted for s in c["spec"]})  # type: ignore[union-attr]
    per_base = {base: systemd_elapses(all_specs, base) for base in BASES}
    problems = []
    for case in cases:
        fields, specs = str(case["cron"]), list(case["spec"])  # type: ignore[call-overload]
        if "error" in case:
            with pytest.raises(CronError) as raised:
                to_oncalendar(fields)
            if str(raised.value) != case["error"]:
                problems.append(f"{fields}: error {raised.value} != {case['error']}")
            continue
        if to_oncalendar(fields) != specs:
            problems.append(f"{fields}: the converter gives {to_oncalendar(fields)}, the table {specs}")
        for base in BASES:
            expected = str(case[_key(base)]).split()
            checks = {"systemd-analyze": merged(per_base[base], specs), "cronsim": cronsim_elapses(fields, base),
                      "oncalendar": oncalendar_elapses(specs, base)}
            problems += [f"{fields} after {base}: {who} gives {got}, the table {expected}"
                         for who, got in checks.items() if got != expected]
    assert problems == []
    assert sum(len(c["spec"]) == 2 for c in converted) >= 10  # type: ignore[arg-type]  # the OR case is well covered


@pytest.mark.parametrize("spec", ["0 2 * * *", "*/5 * * * *", "@daily", "@reboot", "30 4 1,15 * fri"])
def test_cron_syntax_is_recognised(spec: str) -> None:
    assert looks_like_cron(spec)


@pytest.mark.parametrize("spec", ["daily", "*-*-* 02:00:00", "Mon..Fri 09:00", "*:0/5", "Mon *-*-* 00:00 Europe/Berlin"])
def test_calendar_specs_are_not_taken_for_cron(spec: str) -> None:
    assert not looks_like_cron(spec)


def test_zone_is_appended_to_every_spec() -> None:
    assert to_oncalendar("0 3 1 * 1", "Europe/Berlin") == ["Mon *-*-* 03:00:00 Europe/Berlin",
                                                           "*-*-01 03:00:00 Europe/Berlin"]
