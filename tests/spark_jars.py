"""The Jackson jars Iceberg's Spark runtime needs, relocated: ``python -m tests.spark_jars WHEEL
OUT`` (``make .venv-spark-iceberg/.installed`` runs it).

The only offline copy of ``iceberg-spark-runtime-3.5_2.12`` found (1.10.2, inside the
``snowpark-connect-deps-iceberg`` wheel) references Jackson under
``org.apache.iceberg.shaded.com.fasterxml.jackson`` but does not hold it: Spark fails with
``NoClassDefFoundError: .../JsonFactoryBuilder``. This takes Jackson 2.18.8 out of the
``snowpark-connect-deps-2`` wheel (``WHEEL``) and relocates it into that package with Debian's
jarjar (``apt-get install libjarjar-java``), writing ``OUT/shaded-jackson-*.jar`` for
``spark.jars``.
"""

from __future__ import annotations

import io
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

JACKSON = ("core", "databind", "annotations")
VERSION = "2.18.8"
JARJAR = Path("/usr/share/java/jarjar.jar")
RULE = "rule com.fasterxml.jackson.** org.apache.iceberg.shaded.com.fasterxml.jackson.@1\n"


def _without_versions(data: bytes) -> bytes:
    """A multi-release jar without ``META-INF/versions/``: jarjar fails on the duplicates."""
    src = zipfile.ZipFile(io.BytesIO(data))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            if not info.filename.startswith("META-INF/versions/"):
                dst.writestr(info, src.read(info.filename))
    return out.getvalue()


def relocate(wheel: Path, out: Path) -> list[Path]:
    """Write the relocated jars into ``out``; returns their paths."""
    if not JARJAR.exists():
        raise SystemExit(f"{JARJAR} is missing: apt-get install libjarjar-java")
    names = {f"jackson-{j}-{VERSION}.jar": j for j in JACKSON}
    out.mkdir(parents=True, exist_ok=True)
    done = []
    with zipfile.ZipFile(wheel) as z, tempfile.TemporaryDirectory() as tmp:
        rules = Path(tmp) / "rules.txt"
        rules.write_text(RULE)
        found = {n.rsplit("/", 1)[-1]: n for n in z.namelist()}
        for name, part in names.items():
            if name not in found:
                raise SystemExit(f"{wheel} holds no {name}")
            data = z.read(found[name])
            src = Path(tmp) / name
            src.write_bytes(_without_versions(data) if part == "core" else data)
            dest = out / f"shaded-jackson-{part}.jar"
            cmd = ["java", "-jar", str(JARJAR), "process", str(rules), str(src), str(dest)]
            subprocess.run(cmd, check=True)
            done.append(dest)
    return done


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: python -m tests.spark_jars WHEEL OUT")
    for path in relocate(Path(sys.argv[1]), Path(sys.argv[2])):
        print(path)
