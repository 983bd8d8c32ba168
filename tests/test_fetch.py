"""`rayfed-dg data fetch`: against small archives served by an HTTP server on
127.0.0.1 that the test starts (Range support written here), never the
internet: a good archive, a bad checksum, an interrupted download resumed,
an unreachable host, TerraIncognita's arrangement, unsafe archive members."""
import dataclasses
import hashlib
import io
import json
import socket
import tarfile
import threading
import time
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
from PIL import Image

from rayfed_dg.cli import main
from rayfed_dg.data import DataError, dataset_names, load_dataset
from rayfed_dg.data import sources as S
from rayfed_dg.data.fetch import extract, fetch

PACS_DOMAINS = ("photo", "art_painting", "cartoon", "sketch")


def png(seed: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (6, 6, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def pacs_zip() -> bytes:
    """PACS as DomainBed's PACS.zip holds it: kfold/<domain>/<class>/<image>."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for i, d in enumerate(PACS_DOMAINS):
            for c in ("dog", "horse"):
                for k in range(2):
                    z.writestr(f"kfold/{d}/{c}/{k}.png", png(100 * i + 10 * k + len(c)))
    return buf.getvalue()


class Files:
    """What the server serves and how it misbehaves; a log of requests."""

    def __init__(self):
        self.data: dict[str, bytes] = {}
        self.cut_once: dict[str, int] = {}  # path -> bytes sent before dropping the first full response
        self.stall_once: dict[str, int] = {}  # path -> bytes sent before the first full response stalls
        self.ignore_range = False
        self.log: list[tuple[str, str | None]] = []
        self.sent = 0


class Handler(BaseHTTPRequestHandler):
    files: Files
    timeout = 5  # a stuck client cannot hold the server thread

    def log_message(self, *args):  # quiet
        pass

    def do_GET(self):
        f = self.files
        rng = self.headers.get("Range")
        f.log.append((self.path, rng))
        body = f.data.get(self.path)
        if body is None:
            self.send_error(404)
            return
        start = 0
        if rng and not f.ignore_range:
            start = int(rng.removeprefix("bytes=").split("-")[0])
            if start >= len(body):
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{len(body)}")
                self.end_headers()
                return
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
        else:
            self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(body) - start))
        self.end_headers()
        part = body[start:]
        if start == 0 and self.path in f.cut_once:
            part = part[:f.cut_once.pop(self.path)]  # then the connection closes: a lost download
        if start == 0 and self.path in f.stall_once:
            part = part[:f.stall_once.pop(self.path)]
            self.wfile.write(part)
            self.wfile.flush()
            f.sent += len(part)
            time.sleep(6)  # longer than the client's timeout: it gives up on this connection
            return
        self.wfile.write(part)
        f.sent += len(part)


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    files = Files()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), type("H", (Handler,), {"files": files}))
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    files.url = f"http://127.0.0.1:{httpd.server_address[1]}"
    yield files
    httpd.shutdown()
    httpd.server_close()
    thread.join(timeout=5)


def pacs_source(url: str, body: bytes, **kw) -> S.Source:
    archive = S.Archive(url, "PACS.zip", **({"sha256": hashlib.sha256(body).hexdigest(), "size": len(body)} | kw))
    return dataclasses.replace(S.get_source("pacs"), archives=(archive,))


def leftovers(root):
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*"))


def test_good_archive_is_verified_and_installed_in_the_loaders_layout(server, tmp_path, monkeypatch):
    monkeypatch.setenv("RAYFED_DG_CACHE", str(tmp_path / "cache"))
    body = pacs_zip()
    server.data["/PACS.zip"] = body
    root = tmp_path / "data"
    dest = fetch("pacs", root, progress=False, source=pacs_source(server.url + "/PACS.zip", body), timeout=5)
    assert dest == root / "PACS" and sorted(p.name for p in dest.iterdir()) == sorted(PACS_DOMAINS)
    ds = load_dataset("pacs", str(dest), 8)
    assert ds.counts() == dict.fromkeys(PACS_DOMAINS, 4) and ds.class_names == ["dog", "horse"]
    assert leftovers(root / ".downloads") == [] and not (root / ".PACS.partial").exists()  # archive removed
    # a second fetch finds the complete tree and downloads nothing
    n = len(server.log)
    assert fetch("pacs", root, progress=False, source=pacs_source(server.url + "/PACS.zip", body)) == dest
    assert len(server.log) == n


def test_bad_checksum_is_rejected_and_nothing_is_left_half_extracted(server, tmp_path):
    body = pacs_zip()
    server.data["/PACS.zip"] = body
    root = tmp_path / "data"
    src = pacs_source(server.url + "/PACS.zip", body, sha256="0" * 64)
    with pytest.raises(DataError, match=r"PACS.zip .* is not the published file \(SHA-256 [0-9a-f]{64}, expected 0+\)"
                       r".*nothing was extracted"):
        fetch("pacs", root, progress=False, source=src, timeout=5)
    assert leftovers(root) == [".downloads"]  # no PACS, no staging folder, no archive or .part
    # a wrong size is caught the same way
    with pytest.raises(DataError, match=f"size {len(body)} bytes, expected {len(body) + 1}"):
        fetch("pacs", root, progress=False, timeout=5,
              source=pacs_source(server.url + "/PACS.zip", body, size=len(body) + 1))
    assert leftovers(root) == [".downloads"]


@pytest.mark.parametrize("how", ["connection lost", "connection stalls", "earlier run killed",
                                 "server ignores Range"])
def test_interrupted_download_is_resumed(server, tmp_path, how):
    body = pacs_zip()
    half = len(body) // 2
    server.data["/PACS.zip"] = body
    root = tmp_path / "data"
    timeout = 5
    if how == "connection lost":
        server.cut_once["/PACS.zip"] = half
    elif how == "connection stalls":
        server.stall_once["/PACS.zip"] = half
        timeout = 2
    else:
        (root / ".downloads").mkdir(parents=True)
        (root / ".downloads" / "PACS.zip.part").write_bytes(body[:half])
        server.ignore_range = how == "server ignores Range"
    dest = fetch("pacs", root, progress=False, source=pacs_source(server.url + "/PACS.zip", body), timeout=timeout)
    assert sorted(p.name for p in dest.iterdir()) == sorted(PACS_DOMAINS)  # the checksum passed
    if how in ("connection lost", "connection stalls"):
        assert server.log == [("/PACS.zip", None), ("/PACS.zip", f"bytes={half}-")]
        assert server.sent == len(body)  # the second request sent only the rest
    elif how == "earlier run killed":
        assert server.log == [("/PACS.zip", f"bytes={half}-")] and server.sent == len(body) - half
    else:  # a 200 answer to a Range request: the file is fetched from its start, not appended
        assert server.log == [("/PACS.zip", f"bytes={half}-")] and server.sent == len(body)


def test_unreachable_host_is_one_line_naming_the_url_and_the_manual_step(tmp_path, monkeypatch, capsys):
    with socket.socket() as s:  # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/PACS.zip"
    monkeypatch.setitem(S._SOURCES._items, "pacs", pacs_source(url, b"", sha256=None, size=None))
    root = tmp_path / "data"
    code = main(["data", "fetch", "pacs", "--root", str(root), "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("rayfed-dg: error: cannot download pacs: " + url)
    assert f"to {root / '.downloads' / 'PACS.zip'} and run `rayfed-dg data fetch pacs --root {root}` again" in err[0]
    assert leftovers(root) == [".downloads"]


def terra_archives(complete: bool) -> tuple[bytes, bytes]:
    """Images of locations 38, 100, 46 and 99 (not a TerraIncognita one), of classes coyote, bird +
    empty (one image, two classes) and deer (not one of the ten); ``complete`` adds images of
    locations 43 (an int location, as in the CCT file) and 46, so that every location has one."""
    images = {"a.jpg": ("38", ["coyote"]), "b.jpg": ("100", ["bird", "empty"]), "c.jpg": ("46", ["deer"]),
              "d.jpg": ("99", ["coyote"])}
    if complete:
        images |= {"e.jpg": (43, ["empty"]), "f.jpg": ("46", ["coyote"])}
    tbuf = io.BytesIO()
    with tarfile.open(fileobj=tbuf, mode="w:gz") as t:
        for i, name in enumerate(images):
            data = png(i)
            info = tarfile.TarInfo(f"eccv_18_all_images_sm/{name}")
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    cats = {"coyote": 1, "bird": 2, "empty": 3, "deer": 4}
    ann = {"images": [{"id": n[0], "file_name": n, "location": loc} for n, (loc, _) in images.items()],
           "annotations": [{"id": f"{n}{c}", "image_id": n[0], "category_id": cats[c]}
                           for n, (_, cs) in images.items() for c in cs],
           "categories": [{"id": i, "name": c} for c, i in cats.items()]}
    zbuf = io.BytesIO()
    with zipfile.ZipFile(zbuf, "w") as z:
        z.writestr("caltech_images_20210113.json", json.dumps(ann))
    return tbuf.getvalue(), zbuf.getvalue()


def test_terra_incognita_is_arranged_by_location_and_class(server, tmp_path, monkeypatch):
    monkeypatch.setenv("RAYFED_DG_CACHE", str(tmp_path / "cache"))
    images, labels = terra_archives(complete=False)
    server.data.update({"/images.tar.gz": images, "/labels.json.zip": labels})
    real = S.get_source("terra_incognita")
    src = dataclasses.replace(real, archives=(
        dataclasses.replace(real.archives[0], url=server.url + "/images.tar.gz", mirrors=()),
        dataclasses.replace(real.archives[1], url=server.url + "/labels.json.zip", mirrors=())))
    root = tmp_path / "data"
    with pytest.raises(DataError, match="is not what data.name=terra_incognita reads .*expected domain folders "
                                        "location_100, location_38, location_43, location_46; found location_100, "
                                        "location_38.*nothing was installed"):
        fetch("terra_incognita", root, progress=False, source=src, timeout=5)
    assert leftovers(root) == [".downloads", ".downloads/caltech_camera_traps.json.zip",
                               ".downloads/eccv_18_all_images_sm.tar.gz"]  # kept for the next attempt
    # the manual step: complete archives put in .downloads by hand are used as they are
    images, labels = terra_archives(complete=True)
    (root / ".downloads" / "eccv_18_all_images_sm.tar.gz").write_bytes(images)
    (root / ".downloads" / "caltech_camera_traps.json.zip").write_bytes(labels)
    n = len(server.log)
    dest = fetch("terra_incognita", root, progress=False, source=src, timeout=5)
    assert len(server.log) == n  # nothing downloaded
    tree = sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*.jpg"))
    assert tree == ["location_100/bird/b.jpg", "location_100/empty/b.jpg", "location_38/coyote/a.jpg",
                    "location_43/empty/e.jpg", "location_46/coyote/f.jpg"]
    ds = load_dataset("terra_incognita", str(dest), 8)
    assert ds.class_names == ["bird", "coyote", "empty"] and len(ds.labels) == 5
    # archives removed after the install, no staging folder left
    assert [p for p in leftovers(root) if not p.startswith("terra_incognita")] == [".downloads"]


def test_an_archive_without_a_published_checksum_reports_its_own(server, tmp_path, capsys):
    body = pacs_zip()
    server.data["/PACS.zip"] = body
    fetch("pacs", tmp_path / "data", progress=False, timeout=5,
          source=pacs_source(server.url + "/PACS.zip", body, sha256=None))
    err = capsys.readouterr().err
    assert f"PACS.zip: no published SHA-256 to check against; this file's is {hashlib.sha256(body).hexdigest()} " \
           f"({len(body)} bytes)" in err


def test_archive_members_outside_the_target_are_refused(tmp_path):
    bad = tmp_path / "bad.tar"
    with tarfile.open(bad, "w") as t:
        info = tarfile.TarInfo("../escaped.txt")
        info.size = 2
        t.addfile(info, io.BytesIO(b"hi"))
    with pytest.raises(DataError, match="cannot extract"):
        extract(bad, tmp_path / "out")
    assert not (tmp_path / "escaped.txt").exists()


def test_every_source_names_a_loader_and_well_formed_checks():
    for name in S.source_names():
        src = S.get_source(name)
        assert src.loader in dataset_names(), name
        for a in src.archives:
            assert a.url.startswith(("http://", "https://")) and a.filename
            assert a.sha256 is None or (len(a.sha256) == 64 and int(a.sha256, 16) >= 0)
    assert set(S.source_names()) == {"pacs", "office_home", "vlcs", "domainnet", "digits_dg", "camelyon17",
                                     "terra_incognita"}
