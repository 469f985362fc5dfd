"""Tenants kept apart at the scheduler-side connector (vLLM's own Scheduler, no engine):
``require_cache_salt``, multimodal identifiers that are not content hashes, and what kvplug's KV
events say about a salted request (a keyed hash of the salt, never the salt; no token ids)."""

from __future__ import annotations

import hashlib
import logging
import secrets

import pytest

pytest.importorskip("vllm")

from tests.support.vllm_helpers import FakeLookup, make_request, make_scheduler, model_runner_output, prompt


def build(model_dir, **extra):
    s = make_scheduler(model_dir, extra=extra)
    side = s.connector.scheduler_side
    side.lookup = FakeLookup()
    return s, side, side.lookup


def stored(side, fake, req):
    """Mark every full chunk of ``req`` as stored (its hashes as the scheduler computes them)."""
    t = side.track(req)
    fake.stored.update(side.full_hashes(t, req.num_tokens // side.chunk_size))


def step(s):
    scheduler_output = s.schedule()
    metadata = scheduler_output.kv_connector_metadata
    s.update_from_output(scheduler_output, model_runner_output(scheduler_output))
    return metadata


# -- require_cache_salt ---------------------------------------------------------------------------
def test_required_salt_refuses_saltless_requests_and_keeps_salted_ones(model_dir, caplog):
    caplog.set_level(logging.INFO, logger="kvplug")
    s, side, fake = build(model_dir, require_cache_salt=True)
    tokens = prompt(1100, 7)
    bare = make_request("bare", tokens)
    stored(side, fake, bare)  # even with its chunks stored: neither loaded...
    assert side.get_num_new_matched_tokens(bare, 0) == (0, False)
    assert fake.calls == []
    s.add_request(bare)
    assert step(s).requests == []  # ...nor stored: vLLM computes it as usual
    s.add_request(make_request("bare2", prompt(600, 8)))
    assert step(s).requests == []
    salt = secrets.token_hex(8)
    salted = make_request("salted", tokens, cache_salt=salt)
    stored(side, fake, salted)
    assert side.get_num_new_matched_tokens(salted, 0) == (1024, False)
    s.add_request(make_request("salted2", prompt(600, 9), cache_salt=salt))
    (rm,) = step(s).requests
    assert rm.save is not None and rm.save.end == 512
    totals = side.stats.totals()
    assert totals["refused_no_salt"] == 2 and totals.get("refused_mm_ids", 0) == 0
    lines = [r for r in caplog.records if "require_cache_salt" in r.getMessage()]
    assert len(lines) == 1, "logged once"


def test_without_required_salt_a_saltless_request_uses_the_cache(model_dir):
    """The negative control: the same salt-less request loads and stores by default."""
    s, side, fake = build(model_dir)
    bare = make_request("bare", prompt(1100, 7))
    stored(side, fake, bare)
    assert side.get_num_new_matched_tokens(bare, 0) == (1024, False)
    s.add_request(make_request("b2", prompt(600, 8)))
    (rm,) = step(s).requests
    assert rm.save is not None
    assert side.stats.totals().get("refused_no_salt", 0) == 0


# -- multimodal identifiers ----------------------------------------------------------------------
def _mm_request(req_id, identifier, salt=None, lora=None):
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    feature = MultiModalFeatureSpec(data=None, modality="image", identifier=identifier,
                                    mm_position=PlaceholderRange(offset=10, length=300))
    return make_request(req_id, prompt(700, 3), mm_features=[feature], cache_salt=salt,
                        lora_request=lora)


def _content_hash(data: bytes, algo: str = "sha256") -> str:
    return hashlib.new(algo, data).hexdigest()


@pytest.mark.parametrize("identifier,salted,admitted", [
    ("renderer0-mm-3-image-0", False, False),  # vLLM's counter: another image after a restart
    ("renderer0-mm-3-image-0", True, False),  # ...even within one tenant
    ("my-photo-uuid", False, False),  # a client's multi_modal_uuids without a salt
    ("my-photo-uuid", True, True),  # ...with a salt: only its own tenant's entries
    (_content_hash(b"img"), False, True),  # vLLM's content hash (sha256; blake3 is 64 hex too)
    (_content_hash(b"img", "sha512"), False, True),
    (_content_hash(b"img").upper(), False, False),  # not what vLLM's hasher writes
])
def test_mm_requests_cached_only_under_content_hashes(model_dir, caplog, identifier, salted,
                                                      admitted):
    caplog.set_level(logging.INFO, logger="kvplug")
    _, side, fake = build(model_dir)
    reqs = [_mm_request(f"m{i}", identifier, salt="tenant-a" if salted else None)
            for i in range(2)]
    for r in reqs:
        stored(side, fake, r)
        got = side.get_num_new_matched_tokens(r, 0)
        assert got == ((512, False) if admitted else (0, False))
        t = side.trackers[r.request_id]
        assert t.can_save is admitted and t.can_load is admitted
    assert side.stats.totals().get("refused_mm_ids", 0) == (0 if admitted else 2)
    lines = [r for r in caplog.records if "multimodal" in r.getMessage()]
    assert len(lines) == (0 if admitted else 1)


def test_mm_lora_prefixed_content_hash(model_dir):
    """vLLM prefixes the content hash with the LoRA name (tower connector LoRA); another prefix
    is a client's choice."""
    from vllm.lora.request import LoRARequest

    _, side, _ = build(model_dir)
    lora = LoRARequest("adapter-a", 1, "/nonexistent/adapter-a")
    h = _content_hash(b"img")
    assert side.tenants.admits(_mm_request("ok", f"adapter-a:{h}", lora=lora))
    assert not side.tenants.admits(_mm_request("other", f"adapter-b:{h}", lora=lora))
    assert not side.tenants.admits(_mm_request("none", f"adapter-a:{h}"))


# -- KV events ------------------------------------------------------------------------------------
BS, CS = 16, 64


def _event_request(req_id, tokens, salt=None, mm=None):
    from kvplug.tokens import sha256_cbor
    from vllm import SamplingParams
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256_cbor)
    feats = [MultiModalFeatureSpec(data=None, modality="image", identifier=mm,
                                   mm_position=PlaceholderRange(offset=4, length=8))] if mm else None
    return Request(req_id, tokens, SamplingParams(max_tokens=1), None, cache_salt=salt,
                   mm_features=feats, block_hasher=get_request_block_hasher(BS, sha256_cbor))


def _announce(book, req):
    import msgspec
    from kvplug.connector.protocol.metadata import KVPlugKVEvents, TierEvent
    from vllm.distributed.kv_events import KVEventBatch

    book.record(req, 0, CS, [req.request_id.encode() * 4])
    book.add(KVPlugKVEvents([TierEvent(True, "disk", req.request_id.encode() * 4)]))
    raw = msgspec.msgpack.encode(KVEventBatch(ts=0.0, events=book.take()))
    return raw, msgspec.msgpack.decode(raw, type=KVEventBatch).events


def test_events_carry_a_keyed_hash_of_the_salt_never_the_salt():
    from kvplug.connector.scheduler.events import TierEventBook

    salt, image = "tenant-" + secrets.token_hex(6), _content_hash(secrets.token_bytes(8))
    tokens = list(range(100, 100 + CS))
    book = TierEventBook(BS, CS, num_workers=1, salt_key=secrets.token_bytes(32))
    raw, (ev,) = _announce(book, _event_request("a", tokens, salt=salt, mm=image))
    assert salt.encode() not in raw and image.encode() not in raw
    assert ev.token_ids == []  # a salted request's prompt stays off the event bus
    first = ev.extra_keys[0]
    veiled_salt = first[-1]
    assert isinstance(veiled_salt, str) and veiled_salt.startswith("kvplug-hmac:")
    # the same salt gives the same hash within a deployment (a router can group by tenant)...
    _, (ev2,) = _announce(book, _event_request("b", tokens[::-1], salt=salt))
    assert ev2.extra_keys[0][-1] == veiled_salt
    # ...another key (another deployment, or none configured: a key per process) another one
    other = TierEventBook(BS, CS, num_workers=1, salt_key=secrets.token_bytes(32))
    _, (ev3,) = _announce(other, _event_request("c", tokens, salt=salt))
    assert ev3.extra_keys[0][-1] != veiled_salt
    # a request without a salt: as vLLM's own events (it shares with everyone anyway)
    _, (plain,) = _announce(book, _event_request("d", tokens))
    assert plain.token_ids == tokens and plain.extra_keys is None
    # the operator may opt into token ids of salted requests; the salt stays hashed
    book = TierEventBook(BS, CS, num_workers=1, salt_key=b"k" * 32, salted_tokens=True)
    raw, (ev,) = _announce(book, _event_request("e", tokens, salt=salt))
    assert ev.token_ids == tokens and salt.encode() not in raw


def test_event_key_comes_from_the_deployment_secret(monkeypatch):
    """Engines sharing ``auth_key_env``'s secret hash a salt alike; without one, a key per
    process (never a fixed, guessable one)."""
    from types import SimpleNamespace

    from kvplug.connector.scheduler.events import event_key

    cfg = SimpleNamespace(auth_key_env="KVT_SECRET")
    monkeypatch.setenv("KVT_SECRET", secrets.token_hex(32))
    assert event_key(cfg) == event_key(cfg) and len(event_key(cfg)) == 32
    other = event_key(cfg)
    monkeypatch.setenv("KVT_SECRET", secrets.token_hex(32))
    assert event_key(cfg) != other
    monkeypatch.delenv("KVT_SECRET")
    assert event_key(cfg) != event_key(cfg)
    assert event_key(None) != event_key(None)
