"""An agent's channel security is always said: TLS credentials, or plaintext asked for by name."""

from __future__ import annotations

import grpc
import pytest

from fedpar.client.agent import AgentConfig


def test_an_agent_config_without_credentials_must_ask_for_plaintext():
    with pytest.raises(ValueError, match="no credentials.*insecure=True") as err:
        AgentConfig(server="127.0.0.1:1", agent_id="a")
    assert "\n" not in str(err.value)
    assert AgentConfig(server="127.0.0.1:1", agent_id="a", insecure=True).credentials is None
    with pytest.raises(ValueError, match="contradict"):
        AgentConfig(server="127.0.0.1:1", agent_id="a", insecure=True, credentials=grpc.ssl_channel_credentials())
