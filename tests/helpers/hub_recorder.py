"""A hub that records what a push would upload (HfApi patched: nothing leaves the machine)."""

from pathlib import Path

import pytest
from huggingface_hub import HfApi


@pytest.fixture
def hub(monkeypatch):
    """Record what create_repo / upload_folder would send: the files of the uploaded folder, as they are
    then."""
    sent = {}

    def create_repo(self, repo_id, **kwargs):
        sent["create"] = {"repo_id": repo_id, "token": self.token, **kwargs}
        return f"https://huggingface.co/{repo_id}"

    def upload_folder(self, *, repo_id, folder_path, **kwargs):
        root = Path(folder_path)
        sent["files"] = {
            str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
        }
        sent["upload"] = {"repo_id": repo_id, "token": self.token, **kwargs}

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    return sent
