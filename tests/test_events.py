"""schemas.events: the pre-encoded delta frames of the Responses stream are the Structs' own bytes."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("kind", ["text", "refusal", "summary", "arguments"])
@pytest.mark.parametrize(
    ("item_id", "delta"),
    [
        ("msg_0", "hello"),
        ('call_"odd"\\id', 'quote " backslash \\ newline \n tab \t nul \x00 é 😀 </script>'),
        ("rs_1", ""),
    ],
)
def test_delta_frames_are_the_structs_bytes(kind: str, item_id: str, delta: str) -> None:
    """The pre-encoded delta frames are byte for byte what encoding their event Structs gives."""
    from gymproxy.schemas.events import (
        ArgumentsDelta,
        DeltaFrames,
        RefusalDelta,
        SummaryDelta,
        TextDelta,
        encode_event,
    )

    for seq, output_index, index in [(0, 0, 0), (12345, 7, 3)]:
        event = {
            "text": TextDelta("response.output_text.delta", seq, item_id, output_index, index, delta),
            "refusal": RefusalDelta("response.refusal.delta", seq, item_id, output_index, index, delta),
            "summary": SummaryDelta("response.reasoning_summary_text.delta", seq, item_id, output_index, index, delta),
            "arguments": ArgumentsDelta("response.function_call_arguments.delta", seq, item_id, output_index, delta),
        }[kind]
        assert DeltaFrames(event.type, item_id, output_index, index).frame(seq, delta) == encode_event(event)
