"""Build: the folders capture/ and replay/ at the repository's top are installed as forensics.capture and
forensics.replay by a package_dir mapping, so no install route depends on the links forensics/capture and
forensics/replay (development's view: mypy, PYTHONPATH=.), which a checkout with core.symlinks=false and a zip
export lose. Everything else about the package is in setup.cfg."""

from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).resolve().parent
SIDES = ("capture", "replay")  # forensics.<side> is the folder <side>/ beside forensics/

packages = find_packages(
    str(HERE), include=["forensics", "forensics.*"], exclude=[f"forensics.{s}{t}" for s in SIDES for t in ("", ".*")]
)
for side in SIDES:
    packages += [f"forensics.{side}"] + [f"forensics.{side}.{sub}" for sub in find_packages(str(HERE / side))]

setup(packages=packages, package_dir={f"forensics.{side}": side for side in SIDES})
