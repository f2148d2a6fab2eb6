"""The conversation inside: one model of messages, tools and output constraints for every wire
protocol (``conversation``), the families' tool-call formats (``formats``), and the output parser
that turns a turn's text into text and tool-call events (``parse``). Torch-free."""

from .conversation import Conversation, Message, Tool, ToolCall
from .formats import FORMATS, ToolFormat, detect_format
from .parse import CallArgs, CallEnd, CallStart, Event, OutputParser, Text

__all__ = ["FORMATS", "CallArgs", "CallEnd", "CallStart", "Conversation", "Event", "Message", "OutputParser", "Text",
           "Tool", "ToolCall", "ToolFormat", "detect_format"]
