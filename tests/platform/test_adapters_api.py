"""Adapter upload, validation, listing, use in inference, deletion; tenants never see each other's."""

from __future__ import annotations

import io
import json
import logging
import tarfile
import zipfile
from pathlib import Path

import pytest
from platform_helpers import upload

from loraplex.adapters import BaseModelSpec, load_adapter


def _zip(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return buf.getvalue()


def _peft_files(d: Path) -> dict[str, bytes]:
    return {"adapter_config.json": (d / "adapter_config.json").read_bytes(),
            "adapter_model.safetensors": (d / "adapter_model.safetensors").read_bytes()}


def _nothing_stored(app, client, tenant) -> None:
    assert client.get("/v1/adapters", headers=tenant.headers).json()["data"] == []
    settings = app.state.services.settings
    store = settings.resolved_adapter_store_dir
    assert not store.exists() or not any(store.glob("*.safetensors"))
    uploads = settings.data_dir / "uploads"
    assert not uploads.exists() or not any(uploads.iterdir())


def test_upload_zip_becomes_ready_and_serves(app, client, make_tenant, fake_engine, peft_adapter_zip,
                                             peft_adapter_dir, tiny_llama_dir):
    tenant = make_tenant()
    r = upload(client, tenant, "support-bot", [("adapter.zip", peft_adapter_zip.read_bytes())])
    assert r.status_code == 201, r.text
    version = r.json()
    expected = load_adapter(peft_adapter_dir, BaseModelSpec.from_model_dir(tiny_llama_dir)).content_hash
    assert version["status"] == "ready" and version["content_hash"] == expected
    assert version["version"] == expected[:12] and version["rank"] == 4
    # the version says whose it is and what to send as `model` for exactly it
    assert version["object"] == "adapter.version" and version["adapter"] == "support-bot"
    assert version["model"] == f"support-bot@{expected[:12]}"

    listed = client.get("/v1/adapters", headers=tenant.headers).json()["data"]
    assert [a["name"] for a in listed] == ["support-bot"] and listed[0]["latest_version"] == expected[:12]
    models = [m["id"] for m in client.get("/v1/models", headers=tenant.headers).json()["data"]]
    assert models == ["fake-base", "support-bot", f"support-bot@{expected[:12]}"]

    for model in ("support-bot", f"support-bot@{expected[:12]}"):
        r = client.post("/v1/chat/completions", headers=tenant.headers, json={
            "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        assert r.status_code == 200, r.text
        lora = fake_engine.requests[-1]["adapter"]
        assert lora.content_hash == expected and Path(lora.path).is_file()
    app.state.services.tasks.join()
    assert (expected, None) in fake_engine.prefetched  # warmed into the engine once ready, its pin untouched

    # the same bytes again: no new version
    r = upload(client, tenant, "support-bot", [("adapter.zip", peft_adapter_zip.read_bytes())])
    assert r.json()["id"] == version["id"]


def test_uploading_an_older_version_again_rolls_back_to_it(client, make_tenant, tiny_llama_dir, peft_adapter_zip,
                                                           tmp_path, fake_engine, app):
    from loraplex.testing import make_peft_adapter

    tenant = make_tenant()
    first = upload(client, tenant, "bot", [("adapter.zip", peft_adapter_zip.read_bytes())]).json()
    other = make_peft_adapter(tiny_llama_dir, tmp_path / "other", r=4, target_modules=("q_proj",), seed=99)
    second = upload(client, tenant, "bot", list(_peft_files(other).items())).json()
    assert second["version"] != first["version"]
    again = upload(client, tenant, "bot", [("adapter.zip", peft_adapter_zip.read_bytes())])
    assert again.status_code == 201 and again.json()["id"] not in (first["id"], second["id"])
    assert again.json()["version"] == first["version"]
    detail = client.get("/v1/adapters/bot", headers=tenant.headers).json()
    assert detail["latest_version"] == first["version"]
    r = client.post("/v1/chat/completions", headers=tenant.headers,
                    json={"model": "bot", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 200 and fake_engine.requests[-1]["adapter"].content_hash.startswith(first["version"])
    client.portal.call(app.state.services.usage.flush)
    usage = client.get("/v1/usage", headers=tenant.headers).json()["data"]
    assert [(u["adapter"], u["adapter_version"]) for u in usage] == [("bot", first["version"])]  # as typed after @
    ids = [m["id"] for m in client.get("/v1/models", headers=tenant.headers).json()["data"]]
    assert ids.count(f"bot@{first['version']}") == 1  # one version string, listed once
    # the newest upload again changes nothing
    assert upload(client, tenant, "bot", [("adapter.zip", peft_adapter_zip.read_bytes())]).json()["id"] == \
        again.json()["id"]


def test_cli_generate_with_a_tenants_uploaded_adapter(client, make_tenant, peft_adapter_zip, peft_adapter_dir,
                                                      settings, tiny_llama_dir, monkeypatch):
    from click.testing import CliRunner

    from loraplex.cli import main
    from loraplex.engine.llm import LLM
    from loraplex.engine.sampling_params import SamplingParams

    tenant = make_tenant("acme")
    version = upload(client, tenant, "bot", [("adapter.zip", peft_adapter_zip.read_bytes())]).json()["version"]
    monkeypatch.setenv("LORAPLEX_DATA_DIR", str(settings.data_dir))
    monkeypatch.setenv("LORAPLEX_DATABASE_URL", settings.database_url)
    args = ["generate", "--model", str(tiny_llama_dir), "--max-tokens", "5", "Hello world"]
    expected = LLM(str(tiny_llama_dir), max_loras=1, num_kv_blocks=64).generate(
        ["Hello world"], SamplingParams(temperature=0.0, max_tokens=5), adapter=str(peft_adapter_dir),
        use_tqdm=False)[0].outputs[0].text
    for name in ("bot", f"bot@{version}"):
        out = CliRunner().invoke(main, [*args, "--tenant", "acme", "--adapter", name])
        assert out.exit_code == 0 and out.output.strip() == expected.strip(), out.output
    for extra, words in ((["--tenant", "acme", "--adapter", "nobot"], "does not exist"),
                         (["--tenant", "nobody", "--adapter", "bot"], "no tenant 'nobody'"),
                         (["--tenant", "acme"], "give --adapter too")):
        out = CliRunner().invoke(main, [*args, *extra])
        assert out.exit_code != 0 and words in out.output and "Traceback" not in out.output, out.output


def test_upload_two_peft_files_without_waiting(client, make_tenant, peft_adapter_dir, app):
    tenant = make_tenant()
    r = upload(client, tenant, "pair", list(_peft_files(peft_adapter_dir).items()), wait=False)
    assert r.status_code in (201, 202), r.text
    if r.status_code == 202:  # not validated yet: no version to name in `model`
        assert r.json()["model"] is None and r.json()["status"] in ("pending", "validating")
    assert r.json()["adapter"] == "pair"
    app.state.services.tasks.join()
    detail = client.get("/v1/adapters/pair", headers=tenant.headers).json()
    assert detail["status"] == "ready" and detail["versions"][0]["upload_filename"] == "peft-files"


def _bad_adapters(d: Path, tmp: Path) -> dict[str, tuple[list[tuple[str, bytes]], str]]:
    files = _peft_files(d)
    config = json.loads(files["adapter_config.json"])

    def with_config(**changes) -> bytes:
        return json.dumps({**config, **changes}).encode()

    from safetensors.torch import load_file, save_file

    tensors = load_file(str(d / "adapter_model.safetensors"))
    key = next(k for k in tensors if "lora_A" in k)
    nan = {k: v.clone() for k, v in tensors.items()}
    nan[key][0, 0] = float("nan")
    save_file(nan, str(tmp / "nan.safetensors"))
    wrong = {k: v.clone() for k, v in tensors.items()}
    wrong[key] = wrong[key][:, :-1].contiguous()
    save_file(wrong, str(tmp / "wrong.safetensors"))

    tar_buf = io.BytesIO()
    with tarfile.open(fileobj=tar_buf, mode="w:gz") as tf:
        link = tarfile.TarInfo("adapter_config.json")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tf.addfile(link)
    return {
        "pickle": ([("adapter_model.bin", b"\x80\x04K\x01.")], "pickle_file"),
        "traversal": ([("a.zip", _zip({"../adapter_config.json": files["adapter_config.json"]}))],
                      "archive_unsafe_path"),
        "symlink": ([("a.tar.gz", tar_buf.getvalue())], "archive_link"),
        "bad_json": ([("a.zip", _zip({"adapter_config.json": b"{nope",
                                      "adapter_model.safetensors": files["adapter_model.safetensors"]}))],
                     "config_invalid"),
        "no_weights": ([("a.zip", _zip({"adapter_config.json": files["adapter_config.json"]}))],
                       "missing_weights"),
        "rank": ([("adapter_config.json", with_config(r=4096)),
                  ("adapter_model.safetensors", files["adapter_model.safetensors"])], "rank_too_large"),
        "module": ([("adapter_config.json", with_config(target_modules=["lm_head_x"])),
                    ("adapter_model.safetensors", files["adapter_model.safetensors"])], "unknown_target_module"),
        "nan": ([("adapter_config.json", files["adapter_config.json"]),
                 ("adapter_model.safetensors", (tmp / "nan.safetensors").read_bytes())], "non_finite"),
        "shape": ([("adapter_config.json", files["adapter_config.json"]),
                   ("adapter_model.safetensors", (tmp / "wrong.safetensors").read_bytes())], "shape_mismatch"),
        "garbage_safetensors": ([("adapter_config.json", files["adapter_config.json"]),
                                 ("adapter_model.safetensors", b"\x08" + b"\x00" * 7 + b"not json")], "safetensors_corrupt"),
    }


CASES = ["pickle", "traversal", "symlink", "bad_json", "no_weights", "rank", "module", "nan", "shape",
         "garbage_safetensors"]


@pytest.mark.parametrize("case", CASES)
def test_bad_adapter_is_refused_with_reason_and_nothing_stored(app, client, make_tenant, peft_adapter_dir,
                                                               tmp_path, case):
    tenant = make_tenant()
    files, code = _bad_adapters(peft_adapter_dir, tmp_path)[case]
    r = upload(client, tenant, "bad", files)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["code"] == code, err
    assert err["message"].startswith("The adapter was refused: ") and len(err["message"]) > 30
    _nothing_stored(app, client, tenant)


def test_failed_version_keeps_reason_when_not_waiting(app, client, make_tenant, peft_adapter_dir, tmp_path):
    tenant = make_tenant()
    files, code = _bad_adapters(peft_adapter_dir, tmp_path)["nan"]
    r = upload(client, tenant, "later", files, wait=False)
    assert r.status_code in (202, 422)
    app.state.services.tasks.join()
    detail = client.get("/v1/adapters/later", headers=tenant.headers).json()
    assert detail["status"] == "failed" and detail["versions"][0]["error_code"] == code
    assert "non-finite" in detail["versions"][0]["error"] or "NaN" in detail["versions"][0]["error"]
    uploads = app.state.services.settings.data_dir / "uploads"
    assert not any(uploads.iterdir())


def test_oversized_adapter_is_refused_for_what_its_config_declares(app, client, make_tenant, peft_adapter_dir):
    """modules_to_save=["lm_head"] makes a weights file larger than any LoRA of the model: the refusal says
    modules_to_save, the reason a smaller file would meet too, rather than only the size."""
    tenant = make_tenant()
    config = json.loads((peft_adapter_dir / "adapter_config.json").read_bytes())
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("adapter_model.safetensors", b"\0" * (64 * 1024 * 1024))  # a few KB compressed
        zf.writestr("adapter_config.json", json.dumps({**config, "modules_to_save": ["lm_head"]}))
    r = upload(client, tenant, "full-head", [("a.zip", buf.getvalue())])
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["code"] == "modules_to_save_unsupported", err
    assert "modules_to_save=['lm_head']" in err["message"] and "per-file limit" in err["message"], err
    _nothing_stored(app, client, tenant)


@pytest.mark.parametrize("form,param", [
    ({"data": {}, "files": [("file", ("a.zip", b"x"))]}, "name"),
    ({"data": {"name": "bad@name"}, "files": [("file", ("a.zip", b"x"))]}, "name"),
    ({"data": {"name": "ok"}}, "file"),
    ({"data": {"name": "ok"}, "files": [("file", ("adapter_config.json", b"{}"))]}, "file"),
])
def test_malformed_upload_forms_are_400(client, make_tenant, form, param):
    tenant = make_tenant()
    r = client.post("/v1/adapters", headers=tenant.headers, **form)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_declared_oversized_upload_is_refused_before_reading(client, make_tenant, app):
    tenant = make_tenant()
    limit = app.state.services.settings.max_upload_bytes
    r = client.post("/v1/adapters", headers={**tenant.headers, "content-length": str(limit * 2),
                                             "content-type": "multipart/form-data; boundary=x"}, content=b"")
    assert r.status_code == 413 and r.json()["error"]["code"] == "upload_too_large"


def test_tenants_never_see_each_others_adapters(app, client, make_tenant, peft_adapter_zip, fake_engine):
    owner, other = make_tenant(), make_tenant()
    r = upload(client, owner, "private", [("adapter.zip", peft_adapter_zip.read_bytes())])
    version = r.json()["version"]
    assert client.get("/v1/adapters/private", headers=other.headers).status_code == 404
    assert client.get("/v1/adapters", headers=other.headers).json()["data"] == []
    for model in ("private", f"private@{version}"):
        r = client.post("/v1/chat/completions", headers=other.headers, json={
            "model": model, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert client.delete("/v1/adapters/private", headers=other.headers).status_code == 404
    # the same name is free for the other tenant
    assert upload(client, other, "private", [("adapter.zip", peft_adapter_zip.read_bytes())]).status_code == 201


def test_delete_removes_from_engine_and_store(app, client, make_tenant, peft_adapter_zip, fake_engine):
    tenant = make_tenant()
    content_hash = upload(client, tenant, "gone", [("a.zip", peft_adapter_zip.read_bytes())]).json()["content_hash"]
    store = app.state.services.settings.resolved_adapter_store_dir
    assert (store / f"{content_hash}.safetensors").exists()
    r = client.delete("/v1/adapters/gone", headers=tenant.headers)
    assert r.status_code == 200 and r.json() == {"id": "gone", "object": "adapter", "deleted": True}
    assert content_hash in fake_engine.removed
    assert not (store / f"{content_hash}.safetensors").exists()
    r = client.post("/v1/chat/completions", headers=tenant.headers,
                    json={"model": "gone", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404


def test_adapter_routes_need_the_adapters_scope(client, make_tenant):
    tenant = make_tenant(scopes=["inference"])
    assert client.get("/v1/adapters", headers=tenant.headers).status_code == 403


def test_admin_lists_every_tenants_adapters_and_prefetches(app, client, make_tenant, admin_key, peft_adapter_zip,
                                                           fake_engine):
    a, b = make_tenant(), make_tenant()
    admin = {"Authorization": f"Bearer {admin_key}"}
    upload(client, a, "one", [("a.zip", peft_adapter_zip.read_bytes())])
    r = client.post(f"/admin/api/tenants/{b.tenant_id}/adapters", params={"wait": "true"}, headers=admin,
                    data={"name": "two"}, files=[("file", ("a.zip", peft_adapter_zip.read_bytes()))])
    assert r.status_code == 201, r.text
    listed = client.get("/admin/api/adapters", headers=admin).json()
    assert sorted((x["tenant"], x["name"]) for x in listed) == sorted([(a.tenant_name, "one"), (b.tenant_name, "two")])
    assert client.get("/admin/api/adapters", headers=a.headers).status_code == 401
    version_id = r.json()["id"]
    r = client.post(f"/admin/api/adapter-versions/{version_id}/prefetch", headers=admin, json={"pin": True})
    assert r.status_code == 200 and r.json()["pinned"] is True
    assert (r.json()["content_hash"], True) in fake_engine.prefetched
    assert client.delete(f"/admin/api/tenants/{b.tenant_id}/adapters/two", headers=admin).status_code == 200
    assert client.get("/v1/adapters", headers=b.headers).json()["data"] == []


def test_upload_tar_gz(client, make_tenant, peft_adapter_dir):
    tenant = make_tenant()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            tf.add(peft_adapter_dir / name, arcname=f"bot/{name}")
    r = upload(client, tenant, "tarred", [("bot.tar.gz", buf.getvalue())])
    assert r.status_code == 201 and r.json()["status"] == "ready", r.text


def test_same_content_in_another_archive_is_listed_once(client, make_tenant, peft_adapter_zip, peft_adapter_dir):
    tenant = make_tenant()
    first = upload(client, tenant, "bot", [("adapter.zip", peft_adapter_zip.read_bytes())]).json()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            tf.add(peft_adapter_dir / name, arcname=name)
    second = upload(client, tenant, "bot", [("adapter.tar.gz", buf.getvalue())]).json()
    # different upload bytes, the same weights: the same version, recorded as a second upload
    assert second["status"] == "ready" and second["version"] == first["version"] and second["id"] != first["id"]
    models = [m["id"] for m in client.get("/v1/models", headers=tenant.headers).json()["data"]]
    assert models == ["fake-base", "bot", f"bot@{first['version']}"]
    r = client.post("/v1/chat/completions", headers=tenant.headers, json={
        "model": f"bot@{first['version']}", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("stream", [False, True])
def test_an_adapter_that_fails_to_load_is_an_error_not_an_empty_answer(client, make_tenant, fake_engine,
                                                                     peft_adapter_zip, stream, caplog):
    tenant = make_tenant()
    assert upload(client, tenant, "bot", [("adapter.zip", peft_adapter_zip.read_bytes())]).status_code == 201
    fake_engine.adapter_error = "adapter 'bot' could not be loaded: /srv/lp-store/ab12.safetensors does not exist"
    with caplog.at_level(logging.ERROR, logger="loraplex.platform.inference.job"):
        r = client.post("/v1/chat/completions", headers=tenant.headers, json={
            "model": "bot", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": stream})
    assert r.status_code == 500, r.text
    err = r.json()["error"]
    request_id = r.headers["x-request-id"]
    assert err["code"] == "adapter_load_failed" and "'bot'" in err["message"] and request_id in err["message"]
    # the server's store path stays in the server's log, under the request id the client was given
    assert "/srv/lp-store" not in r.text
    assert any(request_id in m and "/srv/lp-store/ab12.safetensors does not exist" in m for m in caplog.messages)
    # the base model is unaffected
    r = client.post("/v1/chat/completions", headers=tenant.headers, json={
        "model": "fake-base", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"



@pytest.mark.parametrize(("description", "words"), [("d" * 513, "at most 512"), ("a\x00b", "NUL")])
def test_a_description_the_database_cannot_hold_is_refused_by_name(client, make_tenant, peft_adapter_zip,
                                                                   description, words):
    tenant = make_tenant()

    def post(desc):
        return client.post("/v1/adapters", params={"wait": "true"}, headers=tenant.headers,
                           data={"name": "bot", "description": desc},
                           files=[("file", ("adapter.zip", peft_adapter_zip.read_bytes()))])

    r = post(description)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "description" and words in err["message"]
    # nothing was registered; the longest description that fits is kept
    assert client.get("/v1/adapters", headers=tenant.headers).json()["data"] == []
    r = post("d" * 512)
    assert r.status_code == 201 and r.json()["status"] == "ready", r.text
    assert client.get("/v1/adapters/bot", headers=tenant.headers).json()["description"] == "d" * 512


@pytest.mark.parametrize("name", ["fake-base", "FAKE-BASE"])
def test_an_adapter_cannot_take_the_base_models_name(app, client, make_tenant, peft_adapter_zip, name):
    """Requests naming the base model reach the base model, so an adapter of that name could never be used
    by its name: the upload is refused, and nothing is stored."""
    tenant = make_tenant()
    r = upload(client, tenant, name, [("adapter.zip", peft_adapter_zip.read_bytes())])
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "name" and "base model" in err["message"]
    assert client.get("/v1/adapters", headers=tenant.headers).json()["data"] == []
    assert [m["id"] for m in client.get("/v1/models", headers=tenant.headers).json()["data"]] == ["fake-base"]
    incoming = list((app.state.services.settings.data_dir / "uploads").glob("*"))
    assert incoming == []


def test_an_adapter_stored_under_the_base_models_name_is_listed_by_version_only(
        app, client, make_tenant, peft_adapter_zip):
    """One already stored under that name (before the base model changed, say) is listed once, as
    name@version; the plain name stays the base model's."""
    from loraplex.platform import registry

    tenant = make_tenant()
    first = upload(client, tenant, "bot", [("adapter.zip", peft_adapter_zip.read_bytes())]).json()
    with app.state.services.sessions() as session:
        ids = [m for m, _c, _n in registry.list_model_ids(session, tenant.tenant_id, "bot")]
    assert ids == [f"bot@{first['version']}"]


@pytest.mark.parametrize("filename", ["..", ".", "...", "dir/.."])
def test_upload_whose_file_name_names_a_folder_is_served(client, make_tenant, peft_adapter_zip, filename):
    """A part's file name of "." or ".." names no file: the upload is kept under a name of its own."""
    tenant = make_tenant()
    r = upload(client, tenant, "dots", [(filename, peft_adapter_zip.read_bytes())])
    assert r.status_code == 201 and r.json()["status"] == "ready", r.text


def test_a_pin_belongs_to_the_version_pinned_not_to_every_tenant_with_the_same_weights(
        client, make_tenant, admin_key, peft_adapter_zip, fake_engine):
    """Two tenants upload the same weights: the engine caches one copy, pinned while either's version is
    pinned. Unpinning one's leaves the other's pinned; deleting the adapter of the last pinned version
    unpins the copy the other tenant still uses."""
    from loraplex.platform.models import AdapterVersion

    a, b = make_tenant(), make_tenant()
    admin = {"Authorization": f"Bearer {admin_key}"}
    va = upload(client, a, "one", [("a.zip", peft_adapter_zip.read_bytes())]).json()
    vb = upload(client, b, "two", [("a.zip", peft_adapter_zip.read_bytes())]).json()

    def pin(version, value):
        r = client.post(f"/admin/api/adapter-versions/{version['id']}/prefetch", headers=admin, json={"pin": value})
        assert r.status_code == 200, r.text
        return r.json()

    first = pin(va, True)
    content = first["content_hash"]
    assert fake_engine.prefetched[-1] == (content, True)
    pin(vb, True)
    assert pin(va, False)["pinned"] is False
    assert fake_engine.prefetched[-1] == (content, True)  # b's version still holds it
    pin(vb, False)
    assert fake_engine.prefetched[-1] == (content, False)
    pin(va, True)
    assert client.delete("/v1/adapters/one", headers=a.headers).status_code == 200
    assert fake_engine.prefetched[-1] == (content, False)  # a's pin went with its adapter
    assert content not in fake_engine.removed  # b still uses the weights
    with client.app.state.services.sessions() as s:
        assert s.get(AdapterVersion, vb["id"]).pinned is False


def test_a_failed_new_upload_leaves_the_adapter_ready(app, client, make_tenant, peft_adapter_zip, peft_adapter_dir,
                                                      tmp_path):
    """The version that serves stays the adapter's status; the failed upload shows in its own version."""
    tenant = make_tenant()
    good = upload(client, tenant, "bot", [("a.zip", peft_adapter_zip.read_bytes())]).json()
    files, code = _bad_adapters(peft_adapter_dir, tmp_path)["nan"]
    assert upload(client, tenant, "bot", files, wait=False).status_code in (202, 422)
    app.state.services.tasks.join()
    detail = client.get("/v1/adapters/bot", headers=tenant.headers).json()
    assert detail["status"] == "ready" and detail["latest_version"] == good["version"]
    assert [v["status"] for v in detail["versions"]] == ["ready", "failed"]
    assert detail["versions"][1]["error_code"] == code


def test_an_adapter_deleted_while_it_validated_leaves_nothing_in_the_store(app, client, make_tenant,
                                                                           peft_adapter_zip, monkeypatch):
    from loraplex.platform.adapter_registry import delete_adapter
    from loraplex.platform.models import Adapter
    from loraplex.platform.tasks.context import get_context

    tenant = make_tenant()
    ctx = get_context()
    real_put = ctx.store.put
    put_hashes = []

    def put_then_deleted(adapter):  # the tenant deletes the adapter while its validation writes the entry
        path = real_put(adapter)
        put_hashes.append(adapter.content_hash)
        with ctx.sessions() as session:
            delete_adapter(session, ctx.settings, session.query(Adapter).filter_by(name="gone").one())
            session.commit()
        return path

    monkeypatch.setattr(ctx.store, "put", put_then_deleted)
    r = upload(client, tenant, "gone", [("a.zip", peft_adapter_zip.read_bytes())])
    assert r.status_code == 404 and r.json()["error"]["code"] == "adapter_not_found", r.text
    app.state.services.tasks.join()
    assert put_hashes and not ctx.store.exists(put_hashes[0]) and ctx.store.list() == []


def test_weights_another_adapter_dropped_meanwhile_are_written_again(app, client, make_tenant, peft_adapter_zip,
                                                                     monkeypatch):
    """Tenant B validates weights tenant A's deleted adapter also had: A's delete, seeing no version refer to
    them yet, removes the store entry between B's write and B's commit; B's version still finds its file."""
    from loraplex.platform.tasks.context import get_context

    ctx = get_context()
    real_put = ctx.store.put

    drops = []

    def put_then_dropped(adapter):  # the first write only: the other adapter's delete happens once
        path = real_put(adapter)
        if not drops:
            drops.append(ctx.store.delete(adapter.content_hash))
        return path

    monkeypatch.setattr(ctx.store, "put", put_then_dropped)
    version = upload(client, make_tenant(), "bot", [("a.zip", peft_adapter_zip.read_bytes())]).json()
    assert drops == [True] and version["status"] == "ready" and ctx.store.exists(version["content_hash"])


@pytest.mark.parametrize("body, message", [
    # the file part never ends: the client stopped sending
    (b'--XYZ\r\nContent-Disposition: form-data; name="name"\r\n\r\nfoo\r\n--XYZ\r\n'
     b'Content-Disposition: form-data; name="file"; filename="a.zip"\r\n\r\nPK\x03\x04abc', "cut short"),
    (b'--XYZ\r\nContent-Disposition: form-data; name="name"\r\n\r\nn1\r\n--XYZ\r\n'
     b'Content-Disposition: form-data; name="name"\r\n\r\nn2\r\n--XYZ--\r\n', "'name' was sent twice"),
])
def test_a_cut_or_ambiguous_multipart_body_is_refused_as_such(app, client, make_tenant, body, message):
    tenant = make_tenant()
    r = client.post("/v1/adapters", params={"wait": "true"}, content=body,
                    headers={**tenant.headers, "content-type": "multipart/form-data; boundary=XYZ"})
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    _nothing_stored(app, client, tenant)


@pytest.mark.parametrize("disposition", [
    b'form-data; name="file"',  # curl -F file=<adapter.zip: the archive as a text field
    b"form-data; name=\"file\"; filename*=UTF-8''%C3%A9t%C3%A9.zip",  # RFC 5987 only, which RFC 7578 forbids
])
@pytest.mark.parametrize("size", [10, 2_000_000])
def test_the_file_sent_as_a_text_field_is_refused_as_such(app, client, make_tenant, peft_adapter_zip, disposition,
                                                          size):
    """It was answered "The form field 'file' is too long." (a large archive) or "No file was uploaded"."""
    tenant = make_tenant()
    data = (peft_adapter_zip.read_bytes() * (size // peft_adapter_zip.stat().st_size + 1))[:size]
    body = (b'--XYZ\r\nContent-Disposition: form-data; name="name"\r\n\r\nbot\r\n--XYZ\r\n'
            b"Content-Disposition: " + disposition + b"\r\n\r\n" + data + b"\r\n--XYZ--\r\n")
    r = client.post("/v1/adapters", params={"wait": "true"}, content=body,
                    headers={**tenant.headers, "content-type": "multipart/form-data; boundary=XYZ"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "file" and "must be a file" in err["message"] and "filename" in err["message"], err
    _nothing_stored(app, client, tenant)


@pytest.mark.parametrize("boundary", ["", "b" * 71, "b" * 5000])
def test_a_boundary_of_the_wrong_length_is_refused_by_name(app, client, make_tenant, peft_adapter_zip, boundary):
    """RFC 2046 boundaries are 1-70 characters; a longer one made the multipart parser raise where no handler
    caught it (a 500), and an empty one was read as if it were a boundary."""
    tenant = make_tenant()
    b = boundary.encode()
    body = (b"--" + b + b'\r\nContent-Disposition: form-data; name="name"\r\n\r\nfoo\r\n--' + b +
            b'\r\nContent-Disposition: form-data; name="file"; filename="a.zip"\r\n\r\n' +
            peft_adapter_zip.read_bytes() + b"\r\n--" + b + b"--\r\n")
    r = client.post("/v1/adapters", params={"wait": "true"}, content=body,
                    headers={**tenant.headers, "content-type": f"multipart/form-data; boundary={boundary}"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert "boundary" in error["message"] and f"has {len(boundary)}" in error["message"]
    assert error["param"] == "file"
    _nothing_stored(app, client, tenant)


def test_one_version_can_be_deleted_and_the_last_takes_the_adapter(app, client, make_tenant, peft_adapter_zip,
                                                                   peft_adapter_dir, tmp_path, fake_engine):
    """A refused upload or an unwanted version goes alone; the adapter then serves its newest remaining
    ready version; deleting its last version deletes it. Another tenant cannot reach either."""
    from loraplex.platform.tasks.context import get_context

    tenant, other = make_tenant(), make_tenant()
    good = upload(client, tenant, "bot", [("a.zip", peft_adapter_zip.read_bytes())]).json()
    files, _code = _bad_adapters(peft_adapter_dir, tmp_path)["nan"]
    upload(client, tenant, "bot", files, wait=False)
    app.state.services.tasks.join()
    failed = client.get("/v1/adapters/bot", headers=tenant.headers).json()["versions"][1]
    assert failed["status"] == "failed"
    path = "/v1/adapters/bot/versions/{}"
    r = client.delete(path.format(failed["id"]), headers=other.headers)
    assert r.status_code == 404 and r.json()["error"]["code"] == "adapter_not_found"
    r = client.delete(path.format(failed["id"]), headers=tenant.headers)
    assert r.status_code == 200 and r.json() == {"id": failed["id"], "object": "adapter.version", "deleted": True,
                                                 "adapter": "bot", "adapter_deleted": False}, r.text
    detail = client.get("/v1/adapters/bot", headers=tenant.headers).json()
    assert [v["id"] for v in detail["versions"]] == [good["id"]]
    r = client.delete(path.format(failed["id"]), headers=tenant.headers)
    assert r.status_code == 404 and r.json()["error"]["code"] == "version_not_found"
    assert client.delete(path.format("x"), headers=tenant.headers).status_code in (400, 422)
    r = client.delete(path.format(good["id"]), headers=tenant.headers)
    assert r.status_code == 200 and r.json()["adapter_deleted"] is True
    assert client.get("/v1/adapters/bot", headers=tenant.headers).status_code == 404
    assert not get_context().store.exists(good["content_hash"])
    assert good["content_hash"] in fake_engine.removed


def test_an_adapters_versions_are_read_and_deleted_by_id_or_by_version(app, client, admin_key, make_tenant,
                                                                        peft_adapter_zip, tiny_llama_dir, tmp_path):
    """GET /v1/adapters/{name}/versions[/{id}] answered a bare 404 "Not Found", and a version named as its
    model name shows it (`bot@<version>`) was refused as "not an integer"."""
    from loraplex.testing import make_peft_adapter

    tenant, other = make_tenant(), make_tenant()
    first = upload(client, tenant, "bot", [("a.zip", peft_adapter_zip.read_bytes())]).json()
    second_dir = make_peft_adapter(tiny_llama_dir, tmp_path / "second", r=4, seed=5)
    files = [(name, (second_dir / name).read_bytes()) for name in ("adapter_config.json", "adapter_model.safetensors")]
    second = upload(client, tenant, "bot", files).json()
    assert first["version"] != second["version"]
    r = client.get("/v1/adapters/bot/versions", headers=tenant.headers)
    assert r.status_code == 200, r.text
    assert r.json()["object"] == "list" and [v["id"] for v in r.json()["data"]] == [first["id"], second["id"]]
    for ref in (first["id"], first["version"]):
        r = client.get(f"/v1/adapters/bot/versions/{ref}", headers=tenant.headers)
        assert r.status_code == 200 and r.json() == first, r.text
    assert client.get("/v1/adapters/bot/versions", headers=other.headers).json()["error"]["code"] == "adapter_not_found"
    r = client.get("/v1/adapters/bot/versions/abcdefabcdef", headers=tenant.headers)
    assert r.status_code == 404 and r.json()["error"]["code"] == "version_not_found", r.text
    for bad in ("x", "0", "99999999999", "bot@" + first["version"]):
        r = client.get(f"/v1/adapters/bot/versions/{bad}", headers=tenant.headers)
        assert r.status_code == 400 and "names no version" in r.json()["error"]["message"], (bad, r.text)
    r = client.delete(f"/v1/adapters/bot/versions/{first['version']}", headers=tenant.headers)
    assert r.status_code == 200 and r.json()["id"] == first["id"] and not r.json()["adapter_deleted"], r.text
    r = client.delete(f"/admin/api/tenants/{tenant.tenant_id}/adapters/bot/versions/{second['version']}",
                      headers={"Authorization": f"Bearer {admin_key}"})
    assert r.status_code == 200 and r.json()["id"] == second["id"] and r.json()["adapter_deleted"], r.text


def test_a_version_held_by_several_rows_is_read_as_the_newest_and_deleted_only_by_id(app, client, make_tenant,
                                                                                      peft_adapter_zip,
                                                                                      peft_adapter_dir):
    """The same weights uploaded again in another archive make a second row with the same `version`: reading
    by `version` answered the older row, and deleting by `version` deleted whichever came first."""
    tenant = make_tenant()
    first = upload(client, tenant, "bot", [("a.zip", peft_adapter_zip.read_bytes())]).json()
    files = [(name, (peft_adapter_dir / name).read_bytes()) for name in ("adapter_config.json",
                                                                         "adapter_model.safetensors")]
    again = upload(client, tenant, "bot", files).json()
    assert again["id"] != first["id"] and again["version"] == first["version"], again
    r = client.get(f"/v1/adapters/bot/versions/{first['version']}", headers=tenant.headers)
    assert r.status_code == 200 and r.json()["id"] == again["id"], r.text
    r = client.delete(f"/v1/adapters/bot/versions/{first['version']}", headers=tenant.headers)
    assert r.status_code == 409, r.text
    message = r.json()["error"]["message"]
    assert f"ids {first['id']}, {again['id']}" in message and "by its id" in message, message
    assert [v["id"] for v in client.get("/v1/adapters/bot", headers=tenant.headers).json()["versions"]] == [
        first["id"], again["id"]]
    r = client.delete(f"/v1/adapters/bot/versions/{first['id']}", headers=tenant.headers)
    assert r.status_code == 200 and not r.json()["adapter_deleted"], r.text
    r = client.delete(f"/v1/adapters/bot/versions/{first['version']}", headers=tenant.headers)
    assert r.status_code == 200 and r.json()["id"] == again["id"] and r.json()["adapter_deleted"], r.text


def test_the_admin_api_deletes_a_tenants_version(app, client, admin_key, make_tenant, peft_adapter_zip):
    tenant = make_tenant()
    good = upload(client, tenant, "bot", [("a.zip", peft_adapter_zip.read_bytes())]).json()
    r = client.delete(f"/admin/api/tenants/{tenant.tenant_id}/adapters/bot/versions/{good['id']}",
                      headers={"Authorization": f"Bearer {admin_key}"})
    assert r.status_code == 200 and r.json()["adapter_deleted"] is True, r.text
    assert client.get("/v1/adapters/bot", headers=tenant.headers).status_code == 404


def test_an_upload_the_worker_cannot_read_is_a_server_error_without_a_path(app, client, make_tenant,
                                                                           peft_adapter_zip, tmp_path, monkeypatch,
                                                                           caplog):
    from loraplex.platform import adapter_registry

    def on_a_worker_with_another_data_dir(settings, version):
        return tmp_path / "worker-data" / "uploads" / str(version.id) / version.upload_filename

    monkeypatch.setattr(adapter_registry, "upload_source", on_a_worker_with_another_data_dir)
    tenant = make_tenant()
    r = upload(client, tenant, "bot", [("a.zip", peft_adapter_zip.read_bytes())])
    assert r.status_code == 500, r.text
    err = r.json()["error"]
    assert err["type"] == "server_error" and err["code"] == "upload_unavailable", err
    assert "a server problem" in err["message"] and str(tmp_path) not in r.text and "uploads" not in r.text
    # as other server-side failures do, it quotes the request id, and the API's log ties that id to the
    # version whose validation failed (the worker's log has the cause under the version's id)
    request_id = r.headers["x-request-id"]
    assert request_id in err["message"], err
    assert any(request_id in m and "adapter version" in m for m in caplog.messages), caplog.messages
