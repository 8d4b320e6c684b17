"""The adapter registry: uploads become versions, versions get validated, names get deleted."""

from __future__ import annotations

import hashlib
import re
import shutil
from pathlib import Path

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from loraplex.config import Settings
from loraplex.platform.errors import bad_request, not_found, shown
from loraplex.platform.models import Adapter, AdapterVersion, VersionStatus
from loraplex.platform.schemas.adapters import AdapterPublic, AdapterVersionPublic
from loraplex.platform.scoping import TenantScope
from loraplex.platform.uploads import ParsedUpload

ADAPTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
ARCHIVE_SUFFIXES = (".zip", ".tar.gz", ".tgz", ".tar")
PEFT_FILES = {"adapter_config.json", "adapter_model.safetensors"}
TERMINAL = {VersionStatus.ready.value, VersionStatus.failed.value}
# a failed version whose staged files the validation could not read: the server's fault, not the adapter's
UPLOAD_UNAVAILABLE = "upload_unavailable"
UPLOAD_UNAVAILABLE_MESSAGE = ("the uploaded files could not be read by the validation worker (a server problem, "
                              "not a problem with the adapter); upload it again later")


def uploads_root(settings: Settings) -> Path:
    return settings.data_dir / "uploads"


def version_upload_dir(settings: Settings, version_id: int) -> Path:
    return uploads_root(settings) / str(version_id)


def upload_source(settings: Settings, version: AdapterVersion) -> Path:
    """What load_adapter reads: the archive itself, or the folder holding the two PEFT files."""
    folder = version_upload_dir(settings, version.id)
    if version.upload_filename in PEFT_FILES or version.upload_filename == "peft-files":
        return folder
    return folder / version.upload_filename


MAX_DESCRIPTION_CHARS = Adapter.__table__.c.description.type.length  # what the column holds (512)


def check_form(upload: ParsedUpload) -> tuple[str, str | None, str, str]:
    """(name, description, upload filename, upload sha256) from a parsed form, or a 400 naming the field."""
    name = upload.fields.get("name", "").strip()
    if not name:
        raise bad_request("The form field 'name' is required.", param="name")
    if not ADAPTER_NAME.fullmatch(name):
        raise bad_request("An adapter name is 1-64 letters, digits, '.', '_' or '-' (no '@'), starting with a "
                          "letter or digit.", param="name")
    description = upload.fields.get("description", "").strip() or None
    if description is not None and len(description) > MAX_DESCRIPTION_CHARS:
        raise bad_request(f"The description is {len(description)} characters; at most {MAX_DESCRIPTION_CHARS} "
                          "are kept.", param="description")
    if description is not None and "\x00" in description:
        raise bad_request("The description must not contain NUL (\\u0000) characters.", param="description")
    files = upload.files
    if not files:
        raise bad_request("No file was uploaded: send a .zip or .tar.gz archive, or adapter_config.json and "
                          "adapter_model.safetensors.", param="file")
    if len(files) == 1:
        f = files[0]
        if not f.filename.lower().endswith(ARCHIVE_SUFFIXES) and f.filename not in PEFT_FILES:
            # pickles and other formats are refused by the validator with its own reason; let it speak
            return name, description, f.filename, f.sha256
        if f.filename in PEFT_FILES:
            missing = sorted(PEFT_FILES - {f.filename})
            raise bad_request(f"{f.filename} needs its companion file {missing[0]}.", param="file")
        return name, description, f.filename, f.sha256
    names = {f.filename for f in files}
    if names != PEFT_FILES or len(files) != 2:
        raise bad_request("Send one archive, or exactly the two PEFT files adapter_config.json and "
                          f"adapter_model.safetensors (got: {', '.join(sorted(names))}).", param="file")
    combined = hashlib.sha256("".join(sorted(f.sha256 for f in files)).encode()).hexdigest()
    return name, description, "peft-files", combined


def register_upload(session: Session, scope: TenantScope, settings: Settings, upload: ParsedUpload,
                    base_model: str | None = None) -> tuple[AdapterVersion, bool]:
    """Create the version row (and the adapter on first upload) and move the files under its id.
    Returns (version, created); the newest version's upload again returns that version, an older version's
    makes it the newest again (a new row of the same content). A name that is
    the base model's (in any case) is refused: requests naming it reach the base model."""
    name, description, filename, sha = check_form(upload)
    if base_model is not None and name.casefold() == base_model.casefold():
        raise bad_request(f"'{name}' is the base model's name; requests naming it reach the base model. "
                          "Choose another name for the adapter.", param="name")
    adapter = scope.one_or_none(Adapter, Adapter.name == name)
    # Registrations of one adapter run one at a time: an upload of the same files at the same time as
    # another then finds the version the other made (read below, after the lock) and returns it, as an
    # upload after it does. A delete that took the adapter meanwhile leaves the name free.
    if adapter is not None and not _claim(session, Adapter, [adapter.id]):
        adapter = None
    if adapter is None:
        adapter = scope.add(Adapter(name=name, description=description))
        session.flush()
    else:
        newest = scope.session.scalars(scope.select(
            AdapterVersion, AdapterVersion.adapter_id == adapter.id,
            AdapterVersion.status != VersionStatus.failed.value).order_by(AdapterVersion.id.desc())).first()
        # The newest version's upload again changes nothing; an older version's is a rollback: a new version
        # row (the same content, so the same version string) that becomes the newest.
        if newest is not None and newest.upload_sha256 == sha:
            upload.discard()
            return newest, False
        if description:
            adapter.description = description
    version = scope.add(AdapterVersion(adapter_id=adapter.id, status=VersionStatus.pending.value,
                                       upload_sha256=sha, upload_filename=filename,
                                       upload_bytes=sum(f.size for f in upload.files)))
    session.flush()
    target = version_upload_dir(settings, version.id)
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(target, ignore_errors=True)
    upload.directory.rename(target)
    return version, True


def adapter_public(adapter: Adapter) -> AdapterPublic:
    versions = sorted(adapter.versions, key=lambda v: v.id)
    ready = [v for v in versions if v.status == VersionStatus.ready.value]
    return AdapterPublic(
        id=adapter.name, name=adapter.name, description=adapter.description,
        # servable as long as a version is ready (a newer upload that failed or still validates is in
        # `versions`); otherwise where the newest upload stands
        status=VersionStatus.ready.value if ready else versions[-1].status if versions else VersionStatus.pending.value,
        latest_version=ready[-1].version if ready else None, created_at=adapter.created_at,
        versions=[AdapterVersionPublic.model_validate(v) for v in versions],
    )


def get_adapter(scope: TenantScope, name: str) -> Adapter:
    adapter = scope.one_or_none(Adapter, Adapter.name == name)
    if adapter is None:
        raise not_found(f"No adapter named '{shown(name)}'.", param="name", code="adapter_not_found")
    return adapter


class DeletedContent(list):
    """Content hashes no longer used by any tenant (the caller drops them from the engine and the store
    after the commit); `unpin` holds, for content still used whose last pinned version went with the
    adapter, the id of a remaining version to unpin it by."""

    def __init__(self, orphaned=(), unpin=()):
        super().__init__(orphaned)
        self.unpin = list(unpin)


def delete_adapter(session: Session, settings: Settings, adapter: Adapter) -> DeletedContent:
    """Delete the adapter and its versions; returns the content hashes to drop (and to unpin)."""
    if not _claim(session, Adapter, [adapter.id]):
        raise not_found(f"No adapter named '{shown(adapter.name)}'.", param="name", code="adapter_not_found")
    session.refresh(adapter, ["versions"])  # with any uploaded meanwhile
    return _delete_versions(session, settings, list(adapter.versions), adapter)


def delete_version(session: Session, settings: Settings, version: AdapterVersion) -> tuple[DeletedContent, bool]:
    """Delete one version (the adapter with it when it was the last one); returns the content hashes to drop
    (and to unpin), and whether the adapter went too. Requests naming the adapter without a version go to
    its newest remaining ready version."""
    adapter = version.adapter
    # the adapter's row first: deletes of its versions run one at a time, each seeing what the others left
    if not (_claim(session, Adapter, [adapter.id]) and _claim(session, AdapterVersion, [version.id])):
        raise not_found(f"Adapter '{shown(adapter.name)}' has no version with id {version.id}.",
                        param="version_id", code="version_not_found")
    session.refresh(adapter, ["versions"])  # as they stand now that no other delete can run beside this one
    last = [v.id for v in adapter.versions] == [version.id]
    return _delete_versions(session, settings, [version], adapter if last else version), last


def _claim(session: Session, model, ids: list[int]) -> bool:
    """Lock these rows for this transaction (a no-op update: row locks on PostgreSQL, the write lock on
    SQLite); False when one is gone, deleted by a request that ran at the same time (which answers for it)."""
    result = session.execute(update(model).where(model.id.in_(ids)).values(id=model.id)
                             .execution_options(synchronize_session=False))
    return result.rowcount == len(ids)


def _delete_versions(session: Session, settings: Settings, versions: list[AdapterVersion], row) -> DeletedContent:
    hashes = {v.content_hash for v in versions if v.content_hash}
    had_pin = {v.content_hash for v in versions if v.content_hash and v.pinned}
    version_ids = [v.id for v in versions]
    session.delete(row)
    session.flush()
    for vid in version_ids:
        shutil.rmtree(version_upload_dir(settings, vid), ignore_errors=True)
    orphaned, unpin = [], []
    for h in sorted(hashes):
        if not content_in_use(session, h):
            orphaned.append(h)
        elif h in had_pin and not content_pinned(session, h):
            other = session.scalar(select(AdapterVersion.id).where(
                AdapterVersion.content_hash == h, AdapterVersion.status == VersionStatus.ready.value).limit(1))
            if other is not None:
                unpin.append(other)
    return DeletedContent(orphaned, unpin)


def content_in_use(session: Session, content_hash: str) -> bool:
    """Whether any version (of any tenant, in any state) refers to these weights: their store entry stays."""
    return bool(session.scalar(select(func.count()).select_from(AdapterVersion)
                               .where(AdapterVersion.content_hash == content_hash)))


def content_pinned(session: Session, content_hash: str) -> bool:
    """Whether the engines keep this content pinned: while any ready version of it is pinned."""
    return bool(session.scalar(select(func.count()).select_from(AdapterVersion).where(
        AdapterVersion.content_hash == content_hash, AdapterVersion.pinned.is_(True),
        AdapterVersion.status == VersionStatus.ready.value)))


def pin_version(session: Session, version: AdapterVersion, pin: bool | None) -> bool | None:
    """Record an operator's pin (True) or unpin (False) on the version; returns what the engines' pin for
    its content becomes (None: pin was None, leave it as it is)."""
    if pin is None:
        return None
    version.pinned = pin
    session.flush()
    return content_pinned(session, version.content_hash)
