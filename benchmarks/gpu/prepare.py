"""Prepare the GPU kit here: the wheels the GPU machine lacks, in .whl/, and the size of what travels.

    python benchmarks/gpu/prepare.py          # the CPU machine's Python with pip (e.g. .venv/bin/python)

Reads ``wheels.txt`` (beside this file): binary wheels are downloaded for CPython 3.12 on manylinux
x86-64 with ``--no-deps``; lines marked ``sdist`` (DeepSpeed, connection-pool) are built here into
pure-Python wheels (``pip wheel --no-deps --no-build-isolation``, ``DS_BUILD_OPS=0``). Wheels in .whl that
the list no longer names are removed (only in the folder this script made). Then every carried wheel's
requirements, and diffpipe's own (pyproject.toml), are checked against the other wheels, the GPU image's packages (``gpu_image_packages.txt``)
and ``left_out.txt``; and the repository as it travels (tracked and untracked-not-ignored files, shared/)
plus .whl is summed. Exit 1 if a requirement is unmet or the total passes 64 MiB.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
WHEELS = ROOT / ".whl"
MARKER = ".diffpipe-gpu-kit"
LIMIT = 64 * 2**20
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux_2_5_x86_64", "manylinux1_x86_64"]


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_list(file: Path) -> list[str]:
    return [line.split("#")[0].strip() for line in file.read_text().splitlines() if line.split("#")[0].strip()]


def wanted() -> tuple[list[str], list[str]]:
    """(binary pins, sdist pins) from wheels.txt."""
    binary, sdist = [], []
    for line in read_list(HERE / "wheels.txt"):
        pin, *flags = line.split()
        (sdist if "sdist" in flags else binary).append(pin)
    return binary, sdist


def folder() -> Path:
    if WHEELS.exists() and any(WHEELS.iterdir()) and not (WHEELS / MARKER).is_file():
        sys.exit(f"prepare: {WHEELS} exists and was not made by this script; move it away first")
    WHEELS.mkdir(exist_ok=True)
    (WHEELS / MARKER).touch()
    return WHEELS


def pip(*args: str, env: dict[str, str] | None = None) -> None:
    cmd = [sys.executable, "-m", "pip", *args]
    print("prepare: " + " ".join(cmd[:6]) + " ...", flush=True)
    proc = subprocess.run(cmd, env=env)
    if proc.returncode:
        sys.exit(f"prepare: pip failed (exit {proc.returncode}): {' '.join(cmd)}")


def fetch(binary: list[str], sdist: list[str]) -> None:
    plat = [x for p in PLATFORMS for x in ("--platform", p)]
    pip("download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
        *plat, "-d", str(WHEELS), *binary)
    env = dict(os.environ, DS_BUILD_OPS="0")  # DeepSpeed: no compiled ops in the wheel
    for pin in sdist:
        name = norm(pin.split("==")[0]).replace("-", "_")
        if not any(norm(p.name.split("-")[0]) == norm(name) for p in WHEELS.glob("*.whl")):
            pip("wheel", "-q", "--no-deps", "--no-build-isolation", "--no-binary", ":all:", "-w", str(WHEELS), pin,
                env=env)


def prune(binary: list[str], sdist: list[str]) -> list[Path]:
    """Remove wheels the list does not pin (another version, or dropped); the wheels that stay."""
    pins = {norm(p.split("==")[0]): p.split("==")[1] for p in binary + sdist}
    keep = []
    for whl in sorted(WHEELS.glob("*.whl")):
        name, version = whl.name.split("-")[:2]
        if pins.get(norm(name)) == version:
            keep.append(whl)
        else:
            print(f"prepare: removing {whl.name} (not pinned in wheels.txt)")
            whl.unlink()
    missing = sorted(set(pins) - {norm(w.name.split("-")[0]) for w in keep})
    if missing:
        sys.exit(f"prepare: no wheel for {', '.join(missing)}")
    return keep


def requirements(whl: Path) -> list[str]:
    """Requirement names of a wheel that apply on CPython 3.12 / Linux without extras."""
    from packaging.markers import default_environment
    from packaging.requirements import Requirement

    env = {**default_environment(), "python_version": "3.12", "python_full_version": "3.12.3",
           "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64", "extra": ""}
    with zipfile.ZipFile(whl) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    out = []
    for line in lines:
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.split(":", 1)[1].strip())
            if req.marker is None or req.marker.evaluate(env):
                out.append(norm(req.name))
    return out


def unmet(keep: list[Path]) -> dict[str, list[str]]:
    """Requirements of diffpipe (pyproject.toml) and of each carried wheel that nothing provides."""
    import tomllib

    from packaging.requirements import Requirement

    carried = {norm(w.name.split("-")[0]) for w in keep}
    image = {norm(n) for n in read_list(HERE / "gpu_image_packages.txt")}
    left_out = {norm(line.split(":")[0]) for line in read_list(HERE / "left_out.txt")}
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    needs = [(norm(Requirement(r).name), "diffpipe") for r in project]
    needs += [(req, whl.name.split("-")[0]) for whl in keep for req in requirements(whl)]
    problems: dict[str, list[str]] = {}
    for req, by in needs:
        if req not in carried | image | left_out:
            problems.setdefault(req, []).append(by)
    return problems


def travel_bytes() -> dict[str, int]:
    """What the device tool sends: tracked and untracked-not-ignored files (shared/ among them), and .whl."""
    def listed(*args: str) -> list[str]:
        out = subprocess.run(["git", "ls-files", "-z", *args], cwd=ROOT, capture_output=True, check=True)
        return [p for p in out.stdout.decode().split("\0") if p]

    def size(paths) -> int:
        return sum((ROOT / p).stat().st_size for p in paths if (ROOT / p).is_file())

    sizes = {"tracked": size(listed()), "untracked": size(listed("--others", "--exclude-standard"))}
    sizes[".whl"] = sum(p.stat().st_size for p in WHEELS.rglob("*") if p.is_file())
    return sizes


def main() -> int:
    binary, sdist = wanted()
    folder()
    fetch(binary, sdist)
    keep = prune(binary, sdist)
    status = 0
    if problems := unmet(keep):
        for req, by in sorted(problems.items()):
            print(f"prepare: {req} (needed by {', '.join(by)}) is neither carried, on the GPU image, nor in "
                  "left_out.txt")
        status = 1
    sizes = travel_bytes()
    total = sum(sizes.values())
    mib = 2**20
    print(f"prepare: {len(keep)} wheels, {sizes['.whl'] / mib:.1f} MiB; repository {sizes['tracked'] / mib:.1f} MiB "
          f"tracked + {sizes['untracked'] / mib:.1f} MiB untracked; total that travels {total / mib:.1f} MiB "
          f"of {LIMIT / mib:.0f} MiB")
    for whl in sorted(keep, key=lambda p: -p.stat().st_size)[:5]:
        print(f"  {whl.stat().st_size / mib:6.1f} MiB  {whl.name}")
    if total > LIMIT:
        print(f"prepare: {total / mib:.1f} MiB is over the {LIMIT / mib:.0f} MiB the GPU machine takes")
        status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
