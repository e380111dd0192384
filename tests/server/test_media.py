"""Which image URLs the server reads: data: always, file:// only inside the allowed folder
(after '..' and symlinks), nothing else."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from vlmbatch.server.media import MediaRefused, check_image_url


@pytest.fixture
def root(tmp_path: Path) -> Path:
    allowed = tmp_path / "media"
    (allowed / "sub").mkdir(parents=True)
    (allowed / "sub" / "a.png").write_bytes(b"png")
    (tmp_path / "secret.txt").write_text("secret")
    os.symlink(tmp_path / "secret.txt", allowed / "escape.png")
    os.symlink(allowed / "sub" / "a.png", allowed / "inside.png")
    return allowed


def test_data_urls_pass_and_file_urls_inside_resolve(root: Path) -> None:
    assert check_image_url("data:image/png;base64,AAAA", None) == "data:image/png;base64,AAAA"
    inside = (root / "sub" / "a.png").as_uri()
    assert check_image_url(f"file://{root}/sub/a.png", root) == inside
    assert check_image_url(f"file://localhost{root}/sub/./a.png", root) == inside
    assert check_image_url(f"file://{root}/inside.png", root) == inside  # a link that stays in
    assert check_image_url(f"file://{root}/sub/%61.png", root) == inside  # percent-encoded


@pytest.mark.parametrize("url, why", [
    ("http://example.com/a.png", "http"),
    ("HTTPS://example.com/a.png", "http"),
    ("ftp://example.com/a.png", "data: URL"),
    ("a.png", "data: URL"),
    ("/etc/passwd", "data: URL"),
    ("file://{root}/../secret.txt", "outside"),
    ("file://{root}/sub/../../secret.txt", "outside"),
    ("file://{root}/%2e%2e/secret.txt", "outside"),
    ("file://{root}/escape.png", "outside"),  # a symlink out of the folder
    ("file:///etc/passwd", "outside"),
    ("file://{root}x/a.png", "outside"),  # a sibling whose name starts the same
    ("file://evil.example{root}/sub/a.png", "host"),
    ("file://../{root}/sub/a.png", "host"),
    ("file://{root}/missing.png", "no readable file"),
    ("file://{root}/sub", "regular file"),
    ("file://{root}/sub/a.png%00.jpg", "NUL"),
])
def test_refused(root: Path, url: str, why: str) -> None:
    with pytest.raises(MediaRefused, match=why):
        check_image_url(url.format(root=root), root)


def test_file_urls_refused_without_an_allowed_folder(root: Path) -> None:
    with pytest.raises(MediaRefused, match="allowed-local-media-path"):
        check_image_url(f"file://{root}/sub/a.png", None)
