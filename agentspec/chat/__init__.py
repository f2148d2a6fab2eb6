"""The conversation inside: one model of messages, tools and output constraints for every wire
protocol (``conversation``), the families' tool-call formats (``formats``), and the output parser
that turns a turn's text into text and tool-call events (``parse``). Torch-free."""

from .conversation import Conversation, Message, Tool, ToolCall
from .formats import FORMATS, ReasoningFormat, ToolFormat, detect_format, detect_reasoning
from .parse import CallArgs, CallEnd, CallStart, Event, OutputParser, Reasoning, Text

__all__ = ["FORMATS", "CallArgs", "CallEnd", "CallStart", "Conversation", "Event", "Message", "OutputParser",
           "Reasoning", "ReasoningFormat", "Text", "Tool", "ToolCall", "ToolFormat", "detect_format", "detect_reasoning"]
