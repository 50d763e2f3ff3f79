"""How Jan and Cortex name a model on the Hugging Face Hub, read as a repository and a file.

- `https://huggingface.co/owner/repo` (or `.../tree/<revision>`): the repository, as `owner/repo`;
- `https://huggingface.co/owner/repo/resolve/<revision>/<path>` or `.../blob/<revision>/<path>`:
  that file when it is a GGUF, else the repository at that revision;
- `owner/repo:quant` (`bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M`): the repository's GGUF file
  whose name carries that quantization, picked once its files are listed (pick_gguf);
- `repo:tag` (`llama3.2:3b-gguf-q4-km`): Cortex's own hub, the branch `tag` of `cortexso/repo`,
  and the one GGUF file it holds.

The router reads a pull's name with hub_name to give the model its id and source URL; the launcher
reads it again to fetch the file (launcher/hub_gguf.py). A plain `owner/repo`, a path or a short
name is none of these: hub_name answers None and the pull takes it as before.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from router.errors import ValidationError

CORTEX_OWNER = "cortexso"  # the organisation Cortex pulls a bare `repo:tag` from
_HUB_HOSTS = ("huggingface.co", "www.huggingface.co", "hf.co")
_PART = r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}"  # an owner's or a repository's name on the Hub
_REPO = re.compile(rf"{_PART}/{_PART}")
_TAGGED = re.compile(rf"(?:(?P<owner>{_PART})/)?(?P<repo>{_PART}):(?P<tag>[A-Za-z0-9._-]{{1,100}})")


@dataclass(frozen=True, slots=True)
class HubName:
    """A Hub repository, and the file of it a name picks (or the quantization that picks it)."""

    repo_id: str
    revision: str | None = None
    filename: str | None = None  # a GGUF file of the repository
    quant: str | None = None  # pick the GGUF whose name carries it (None with a tag: the one GGUF)
    one_gguf: bool = False  # Cortex's `repo:tag`: the branch holds one GGUF file

    @property
    def picks_gguf(self) -> bool:
        """Whether the name picks a GGUF file (converted) rather than the repository's checkpoint."""
        return self.filename is not None or self.quant is not None or self.one_gguf

    @property
    def url(self) -> str:
        """The name as a Hub URL (Jan's source_url)."""
        base = f"https://huggingface.co/{self.repo_id}"
        if self.filename is not None:
            return f"{base}/resolve/{self.revision or 'main'}/{self.filename}"
        return f"{base}/tree/{self.revision}" if self.revision else base

    @property
    def model_id(self) -> str:
        """The id a pull of it gets when it names none."""
        if self.filename is not None:
            return self.filename.rsplit("/", 1)[-1].removesuffix(".gguf")
        repo = self.repo_id.rsplit("/", 1)[-1] if self.one_gguf else self.repo_id
        tag = self.quant or (self.revision if self.one_gguf else None)
        return f"{repo}-{tag}" if tag else repo


def hub_name(source: str) -> HubName | None:
    """The Hub repository (and file) `source` names in Jan's or Cortex's ways, else None.

    A Hub URL this cannot read is a 422 rather than a path of that name."""
    if source.startswith(("https://", "http://")):
        return _from_url(source)
    match = _TAGGED.fullmatch(source)
    if match is None:
        return None
    owner, repo, tag = match["owner"], match["repo"], match["tag"]
    if owner is None:  # Cortex's built-in models: a branch per variant
        return HubName(f"{CORTEX_OWNER}/{repo}", revision=tag, one_gguf=True)
    return HubName(f"{owner}/{repo}", quant=tag)


def _from_url(source: str) -> HubName:
    try:
        url = urlsplit(source)
        host = url.hostname
    except ValueError:  # "https://[": no URL at all
        host = None
    # unquoted first: `%2F` is a separator too, so no `..` hides in one part
    parts = [p for p in unquote(url.path).split("/") if p] if host else []
    if host not in _HUB_HOSTS or len(parts) < 2:
        raise ValidationError(f"`model` {source[:200]!r} is not a Hugging Face Hub URL: pull a "
                              "URL of https://huggingface.co/<owner>/<repo>[/resolve/<revision>/"
                              "<file>.gguf], a Hub id, a short name or a local path")
    repo_id = f"{parts[0]}/{parts[1]}"
    if not _REPO.fullmatch(repo_id):
        raise ValidationError(f"`model`: {repo_id!r} is not a Hub repository name")
    rest = parts[2:]
    if ".." in rest:
        raise ValidationError("`model`: a Hub URL's revision or file path cannot hold '..'")
    if not rest:
        return HubName(repo_id)
    if rest[0] == "tree" and len(rest) >= 2:
        return HubName(repo_id, revision="/".join(rest[1:]))
    if rest[0] in ("resolve", "blob") and len(rest) >= 3:
        revision, path = rest[1], "/".join(rest[2:])
        if path.lower().endswith(".gguf"):
            return HubName(repo_id, revision=revision, filename=path)
        return HubName(repo_id, revision=revision)  # a file of a checkpoint: the checkpoint
    raise ValidationError(f"`model`: {source[:200]!r} names no repository, branch or file of the "
                          "Hub (…/tree/<revision>, …/resolve/<revision>/<file>, …/blob/…)")


def pick_gguf(files: list[str], name: HubName) -> str:
    """The GGUF file of a repository's `files` that `name` picks; ValueError if none or several."""
    ggufs = [f for f in files if f.lower().endswith(".gguf")]
    if name.quant is not None:
        # Q4_K must not pick Q4_K_M: the quantization ends where letters, digits and _ end
        pattern = re.compile(rf"(?<![A-Za-z0-9]){re.escape(name.quant)}(?![A-Za-z0-9_])",
                             re.IGNORECASE)
        picked = [f for f in ggufs if pattern.search(f.rsplit("/", 1)[-1])]
        kind = f" of quantization {name.quant}"
    else:
        picked, kind = ggufs, ""
    if len(picked) == 1:
        return picked[0]
    where = f"{name.repo_id}" + (f" at {name.revision}" if name.revision else "")
    if not picked:
        listed = ", ".join(g.rsplit("/", 1)[-1] for g in ggufs[:20]) or "none"
        raise ValueError(f"{where} has no GGUF file{kind} (its GGUF files: {listed})")
    raise ValueError(f"{where} has {len(picked)} GGUF files{kind} ({', '.join(picked[:10])}): "
                     "name the file with a .../resolve/<revision>/<file>.gguf URL")
