"""Fetch the engines' own KV-event publisher modules for the interop tests.

For each release in releases.json (optionally only one tier), pip downloads
the pinned wheel with --no-deps and --require-hashes into a scratch folder,
copies only the listed files out of it into DEST/<release name>/, and deletes
the wheel: the tests load those files by path with small stubs
(testdata/engines/release_peer.py), so neither the engine's dependencies
(torch, CUDA) nor its 300 MB wheel stay on the machine. A release whose files
are already in place (same wheel hash, recorded in .sha256) is skipped.

  python fetch.py DEST [--tier newest|long|all]

It prints, per release, the seconds and bytes the download cost.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))


def fetch(release: dict, dest: str) -> None:
    out = os.path.join(dest, release["name"])
    stamp = os.path.join(out, ".sha256")
    if os.path.exists(stamp) and open(stamp).read().strip() == release["sha256"]:
        if all(os.path.exists(os.path.join(out, f)) for f in release["files"]):
            print(f"{release['name']}: present", flush=True)
            return
    with tempfile.TemporaryDirectory(prefix="kvrelay-engine-") as tmp:
        req = os.path.join(tmp, "requirements.txt")
        with open(req, "w") as f:
            f.write(f"{release['requirement']} --hash=sha256:{release['sha256']}\n")
        start = time.monotonic()
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
             "--no-deps", "--require-hashes", "-r", req, "-d", tmp, *release["pip_args"]],
            check=True,
        )
        wheels = [n for n in os.listdir(tmp) if n.endswith(".whl")]
        if len(wheels) != 1:
            raise SystemExit(f"{release['name']}: expected one wheel, got {wheels}")
        wheel = os.path.join(tmp, wheels[0])
        size = os.path.getsize(wheel)
        shutil.rmtree(out, ignore_errors=True)
        os.makedirs(out)
        with zipfile.ZipFile(wheel) as z:
            for name in release["files"]:
                target = os.path.join(out, name)
                os.makedirs(os.path.dirname(target), exist_ok=True)
                with z.open(name) as src, open(target, "wb") as dst:
                    shutil.copyfileobj(src, dst)
        with open(stamp, "w") as f:
            f.write(release["sha256"] + "\n")
        print(f"{release['name']}: {wheels[0]}, {size / 1e6:.1f} MB in "
              f"{time.monotonic() - start:.1f} s, kept {len(release['files'])} file(s)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dest")
    ap.add_argument("--tier", default="all", choices=["newest", "long", "all"])
    args = ap.parse_args()
    with open(os.path.join(HERE, "releases.json")) as f:
        releases = json.load(f)["releases"]
    for release in releases:
        if args.tier == "all" or release["tier"] == args.tier:
            fetch(release, args.dest)


if __name__ == "__main__":
    main()
