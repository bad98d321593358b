"""protocols/common.py's text-piece joiner and protocols/http_speech.py's piecewise base64."""

from __future__ import annotations

import base64

import pytest

from agent_server.protocols.common import PieceJoiner
from agent_server.protocols.http_speech import Base64Stream


@pytest.mark.parametrize(("pieces", "joined"), [
    (["Sure, I can help.", "Your flight leaves at nine."], "Sure, I can help. Your flight leaves at nine."),
    (["Hel", "lo there", ", friend", "! How", " are you?"], "Hello there, friend! How are you?"),  # tokens: as sent
    (["It costs ", "3", ".", "5", " dollars."], "It costs 3.5 dollars."),  # tokens: a number stays one number
    (["It costs 3", ".", "5 dollars."], "It costs 3.5 dollars."),  # a token ends on the point
    (["1,", "000 people"], "1,000 people"),
    # sentences with their spaces stripped (Pipecat): two sentences, not "12.3"
    (["Your order number is 12.", "3 items shipped today."], "Your order number is 12. 3 items shipped today."),
    (["Wait", "...", "what?"], "Wait... what?"),
    (["Done.", " Next.", "\nAnd then."], "Done. Next.\nAnd then."),  # pieces with their own spaces: untouched
    (["Really?", "\"Yes\""], "Really?\"Yes\""),  # not a letter or digit: no space added
    (["", "Hi.", "", "There."], "Hi. There."),
])
def test_pieces_join_as_they_were_meant(pieces: list[str], joined: str) -> None:
    joiner = PieceJoiner()
    assert "".join(joiner.join(p) for p in pieces) == joined


@pytest.mark.parametrize("sizes", [[1, 1, 1, 1, 1], [2, 5, 7], [3, 3, 3], [100], [4, 0, 9, 1]])
def test_base64_in_pieces_is_the_base64_of_the_whole(sizes: list[int]) -> None:
    data = bytes(range(256)) * 2
    stream = Base64Stream()
    out, at = b"", 0
    for size in sizes:
        piece = stream.push(data[at:at + size])
        assert len(piece) % 4 == 0  # each piece is whole base64 groups: a JSON string can be written as it comes
        out += piece
        at += size
    out += stream.finish()
    assert out == base64.b64encode(data[:at])
