"""Prints each package of requirements-lock.txt whose installed version differs from the locked one."""
import re
from importlib import metadata
from pathlib import Path

LOCK = Path(__file__).resolve().parents[1] / "requirements-lock.txt"

differ = 0
for name, version in re.findall(r"^([A-Za-z0-9._-]+)==(\S+)", LOCK.read_text(), re.M):
    try:
        installed = metadata.version(name)
    except metadata.PackageNotFoundError:
        installed = "absent"
    if installed != version:
        differ += 1
        print(f"  {name}: {installed} (lock {version})")
print(f"{differ} of the lock's packages differ")
