import os
import pathlib

import pytest

from gaps.testing import local_cluster

LAYOUT = """
chunk_elems = 16

[[tensor]]
name = "w"
shape = [5, 4]

[[tensor]]
name = "b"
shape = [4]

[[table]]
name = "emb"
dim = 3
"""


@pytest.fixture(scope="module")
def layout_file(tmp_path_factory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("layout") / "layout.toml"
    path.write_text(LAYOUT)
    return path


@pytest.fixture(scope="module")
def cluster(layout_file):
    with local_cluster(layout_file, servers=2, rule="sgd", lr=0.5) as c:
        yield c


def pytest_report_header(config):
    return f"GAPS_BIN_DIR={os.environ.get('GAPS_BIN_DIR', '(PATH)')}"
