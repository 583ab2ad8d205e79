"""kvring.nixl's listener messages (metadata sent with ``_LOAD``, withdrawn
with ``_DROP``) and the agent's token (issue 27, row 11; SECURITY-REVIEW
row 13): each attack is made as an outsider would, from an engine of its
own, against a real agent."""

import logging

import pytest

import kvring
from kvring.nixl import _agent, _listener, nixl_agent

TOKEN = b"cluster-token-for-these-tests"


def _agents_see(agent):
    """Lets ``agent`` act on its listener messages: any call that looks
    does, and a notification is queued at the receiver before ``notify``
    returns."""
    agent.get_new_notifs()


def _refusals(caplog):
    return [r.getMessage() for r in caplog.records if "listener message" in r.getMessage() and "refused" in r.getMessage()]


@pytest.fixture
def victim_and_prefill():
    victim = nixl_agent("decode", token=TOKEN)
    prefill = nixl_agent("prefill", token=TOKEN)
    victim.add_remote_agent(prefill.get_agent_metadata())
    yield victim, prefill
    for agent in (victim, prefill):
        agent._close()


def _load_message(key, sender, receiver, agent):
    return _listener.encode(key, _listener.LOAD, sender, receiver, agent.get_agent_metadata())


def test_a_listener_message_without_the_right_token_is_refused(victim_and_prefill, caplog):
    victim, prefill = victim_and_prefill
    mallory = nixl_agent("mallory", token=TOKEN)  # a proven peer: holds the cluster's token
    try:
        # No token, or another: the engine's handshake refuses the sender.
        for token in (None, b"another-token"):
            outsider = kvring.Engine(name="outsider", token=token)
            try:
                message = _load_message(_listener.key(token), "outsider", "decode", mallory)
                with pytest.raises((kvring.UnauthorizedError, kvring.PeerRestartedError, kvring.KvringError)):
                    outsider.notify(victim._engine.control_addr, message, timeout=2.0)
            finally:
                outsider.close()
        # A proven peer's message whose proof is under another token, made
        # for another receiver, or sent a second time (a replay).
        peer = kvring.Engine(name="mallory", token=TOKEN)
        caplog.set_level(logging.ERROR, logger="kvring.nixl")
        try:
            forged = [
                _load_message(_listener.key(b"another-token"), "mallory", "decode", mallory),
                _load_message(_listener.key(TOKEN), "mallory", "someone-else", mallory),
                _listener.CONTROL + _listener.LOAD + b"\x00" + mallory.get_agent_metadata(),  # no proof at all
            ]
            for message in forged:
                peer.notify(victim._engine.control_addr, message)
            _agents_see(victim)
            assert not victim.check_remote_metadata("mallory")
            refused = _refusals(caplog)
            assert len(refused) == 3, refused
            assert all("does not verify" in r for r in refused), refused

            good = _load_message(_listener.key(TOKEN), "mallory", "decode", mallory)
            peer.notify(victim._engine.control_addr, good)
            _agents_see(victim)
            assert victim.check_remote_metadata("mallory")  # the right token's message is taken
            victim.remove_remote_agent("mallory")
            peer.notify(victim._engine.control_addr, good)  # the same bytes again
            _agents_see(victim)
            assert not victim.check_remote_metadata("mallory")
            assert "a replay" in _refusals(caplog)[-1]
        finally:
            peer.close()
        assert victim.check_remote_metadata("prefill")
    finally:
        mallory._close()


def test_load_cannot_re_point_an_agent_name_it_did_not_come_from(victim_and_prefill, caplog):
    victim, prefill = victim_and_prefill
    real = victim._remotes["prefill"]
    caplog.set_level(logging.ERROR, logger="kvring.nixl")
    key = _listener.key(TOKEN)
    # Mallory's own engine named "prefill" (it may name itself anything).
    impostor = nixl_agent("prefill", token=TOKEN)
    mallory = kvring.Engine(name="mallory", token=TOKEN)
    try:
        # From mallory: the impostor's metadata, then the real prefill's.
        mallory.notify(victim._engine.control_addr, _load_message(key, "mallory", "decode", impostor))
        mallory.notify(victim._engine.control_addr, _load_message(key, "mallory", "decode", prefill))
        _agents_see(victim)
        refused = _refusals(caplog)
        assert len(refused) == 2 and all("an agent sends only its own" in r for r in refused), refused
        assert victim._remotes["prefill"] == real and "mallory" not in victim._remotes

        # From the impostor itself, as "prefill": the real prefill still answers.
        impostor.send_local_metadata("127.0.0.1", victim._engine.port)
        _agents_see(victim)
        assert "while %s still answers as it" % real in _refusals(caplog)[-1]
        assert victim._remotes["prefill"] == real

        # Once the real one is gone, its name may move (a restart elsewhere).
        prefill._close()
        impostor.send_local_metadata("127.0.0.1", victim._engine.port)
        _agents_see(victim)
        assert victim._remotes["prefill"] == impostor._engine.control_addr
    finally:
        mallory.close()
        impostor._close()


def test_drop_checks_its_sender(victim_and_prefill, caplog):
    victim, prefill = victim_and_prefill
    caplog.set_level(logging.ERROR, logger="kvring.nixl")
    key = _listener.key(TOKEN)
    other = nixl_agent("other", token=TOKEN)
    victim.add_remote_agent(other.get_agent_metadata())
    # An engine named as prefill (its handshake says "prefill"), withdrawing
    # prefill at its own epoch, and a correct withdrawal under another name.
    impostor = kvring.Engine(name="prefill", token=TOKEN)
    try:
        _name, epoch, _t = impostor._native.segment_info(impostor.control_addr, 2.0)
        impostor.notify(victim._engine.control_addr, _listener.encode(key, _listener.DROP, "prefill", "decode", epoch.to_bytes(8, "big")))
        _agents_see(victim)
        assert "a withdrawal of agent 'prefill' at epoch" in _refusals(caplog)[-1]
        assert victim.check_remote_metadata("prefill")
        # "other" withdrawing itself does not touch prefill.
        other.invalidate_local_metadata("127.0.0.1", victim._engine.port)
        _agents_see(victim)
        assert not victim.check_remote_metadata("other") and victim.check_remote_metadata("prefill")
        # prefill's own withdrawal is taken.
        prefill.invalidate_local_metadata("127.0.0.1", victim._engine.port)
        _agents_see(victim)
        assert not victim.check_remote_metadata("prefill")
    finally:
        impostor.close()
        other._close()


def test_the_token_comes_from_kvring_token_and_without_one_the_agent_warns_once(monkeypatch, caplog):
    caplog.set_level(logging.WARNING, logger="kvring.nixl")
    monkeypatch.setattr(_agent, "_warned_no_token", False)
    monkeypatch.delenv("KVRING_TOKEN", raising=False)
    a, b = nixl_agent("a"), nixl_agent("b")
    warnings = [r.getMessage() for r in caplog.records if "has no token" in r.getMessage()]
    assert len(warnings) == 1 and "can send it metadata, re-point agents" in warnings[0], warnings
    for agent in (a, b):
        agent._close()

    monkeypatch.setenv("KVRING_TOKEN", TOKEN.decode())
    caplog.clear()
    monkeypatch.setattr(_agent, "_warned_no_token", False)
    from_env = nixl_agent("from-env")
    assert not [r for r in caplog.records if "has no token" in r.getMessage()]
    with_arg = nixl_agent("with-arg", token=TOKEN)
    wrong = nixl_agent("wrong", token=b"another-token")
    try:
        # The environment's token is proven to a peer given it as an argument...
        assert with_arg.add_remote_agent(from_env.get_agent_metadata()) == b"from-env"
        # ...and a peer with another token is refused at the handshake.
        with pytest.raises(kvring.UnauthorizedError):
            wrong.add_remote_agent(from_env.get_agent_metadata())
        with pytest.raises(kvring.InvalidArgumentError, match="non-empty"):
            nixl_agent("empty-token", token=b"")
    finally:
        for agent in (from_env, with_arg, wrong):
            agent._close()


def test_any_bytes_as_a_listener_message_are_refused_with_a_clear_error():
    # The decoder of outside bytes: random messages, and every cut and
    # single-byte change of a good one, are refused as UnauthorizedError
    # and nothing else (a good one opens).
    import random

    key = _listener.key(TOKEN)
    verifier = _listener.Verifier(key, "decode")
    good = _listener.encode(key, _listener.DROP, "prefill", "decode", (7).to_bytes(8, "big"))
    rng = random.Random(26)
    candidates = [_listener.CONTROL + bytes(rng.randrange(256) for _ in range(rng.randrange(80))) for _ in range(500)]
    candidates += [good[:cut] for cut in range(len(_listener.CONTROL), len(good))]
    for at in range(len(_listener.CONTROL), len(good)):
        changed = bytearray(good)
        changed[at] ^= 0x01
        candidates.append(bytes(changed))
    for message in candidates:
        with pytest.raises(kvring.UnauthorizedError):
            verifier.open("prefill", message)
    assert verifier.open("prefill", good) == (_listener.DROP, (7).to_bytes(8, "big"))
    with pytest.raises(kvring.UnauthorizedError, match="replay"):
        verifier.open("prefill", good)
