"""A chat request's tools: what the model is shown, what grammar forces, and how output is read.

Two ways to read calls, as TGI and vLLM have them. TGI's, the default: a grammar forces JSON calls
(`[{"name": ..., "arguments": ...}, ...]`, one object when `parallel_tool_calls` is false), and under
tool_choice=auto the pseudo-call `no_tool` answers in words. vLLM's, with --tool-call-parser and
--enable-auto-tool-choice: under auto the model writes freely in its own format and the parser
reads its calls; `required` and a named function still use the grammar.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from router.errors import ValidationError
from router.inputs import structured_output
from router.inputs.field_ranges import read_flag
from router.inputs.tool_parsers import PARSERS, JsonCalls

# TGI's default `tool_prompt` (router/src/lib.rs, default_tool_prompt)
DEFAULT_TOOL_PROMPT = ("\nGiven the functions available, please respond with a JSON for a function "
                       "call with its proper arguments that best answers the given prompt. Respond "
                       "in the format {name: function name, parameters: dictionary of argument "
                       "name and its value}.Do not use variables.\n")
# TGI's no_tool function, as the tools listed to a template that cannot show them name it
_NO_TOOL_FUNCTION = {"name": structured_output.NO_TOOL,
                     "description": "Open ended response with no specific tool selected",
                     "parameters": {"type": "object", "properties": {"content": {
                         "type": "string", "description": "The response content"}},
                         "required": ["content"]}}


def _functions(tools) -> list[dict]:
    if not isinstance(tools, list) or not tools:
        raise ValidationError("`tools` must be a non-empty list")
    functions, names = [], set()
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or tool.get("type", "function") != "function" \
                or not isinstance(function.get("name"), str):
            raise ValidationError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": "
                                  "{\"name\": ..., \"parameters\": ...}}")
        if not function["name"] or function["name"] == structured_output.NO_TOOL:
            raise ValidationError(f"tools[{i}].function.name must be a non-empty name other "
                                  f"than {structured_output.NO_TOOL!r} (the name this server gives "
                                  "a reply in words)")
        if function["name"] in names:  # a set: a list search made 20,000 tools take 18 s
            raise ValidationError(f"tools[{i}]: a function named {function['name']!r} is "
                                  "already offered; each tool needs a name of its own")
        names.add(function["name"])
        if "parameters" not in function and "arguments" in function:
            # TGI's FunctionDefinition names the schema `arguments` (`parameters` its alias):
            # the grammar and the template read it under OpenAI's name
            function = {**{k: v for k, v in function.items() if k != "arguments"},
                        "parameters": function["arguments"]}
        functions.append(function)
    return functions


@dataclass(slots=True)
class ToolPlan:
    """What tools and tool_choice ask for."""

    functions: list[dict] | None = None  # shown to the model
    grammar: tuple[str, str] | None = None  # forces JSON calls of them
    allow_text: bool = False  # under the grammar, the no_tool pseudo-call answers in words
    parallel: bool = True  # several calls in one answer
    parser: str | None = None  # --tool-call-parser reads the calls (tool_choice=auto)
    prompt: str | None = None  # TGI's tool_prompt, added to the last message
    # --tool-call-parser, whose model's call ids every call gets (the grammar's too)
    ids_of: str | None = None

    def new_call_id(self) -> str:
        """A call's id: its model's own kind where the template wants one, else OpenAI's.

        Mistral's templates take back nine letters and digits only (vLLM gives Mistral's models
        such ids)."""
        own = getattr(PARSERS.get(self.parser or self.ids_of), "call_id", None)
        return own() if own is not None else f"call_{uuid.uuid4().hex[:24]}"

    @property
    def skips_special_tokens(self) -> bool:
        """False where the parser reads a special token (Mistral's [TOOL_CALLS]), as vLLM's do."""
        return self.parser is None or not PARSERS[self.parser].reads_special_tokens

    @property
    def reads_calls(self) -> bool:
        return self.grammar is not None or self.parser is not None

    def reader(self):
        """A new reader of one choice's output (router.inputs.tool_parsers), or None."""
        if self.grammar is not None:
            return JsonCalls(no_tool=structured_output.NO_TOOL if self.allow_text else None)
        if self.parser is not None:
            return PARSERS[self.parser]()
        return None


def _choice(body: dict) -> str | dict:
    """tool_choice as "none", "auto", "required" or {"name": <the function>}."""
    choice = body.get("tool_choice")
    if choice is None:
        return "auto" if body.get("tools") else "none"
    if isinstance(choice, str):
        if choice in ("none", "auto", "required"):
            return choice
        if choice:  # TGI's ToolType: a bare string names the function
            return {"name": choice}
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict) \
            and choice.get("type", "function") == "function" \
            and isinstance(choice["function"].get("name"), str):
        return {"name": choice["function"]["name"]}
    raise ValidationError("`tool_choice` must be none, auto, required, a function's name or "
                          "{\"type\": \"function\", \"function\": {\"name\": ...}}")


def _tool_prompt(body: dict) -> str | None:
    prompt = body.get("tool_prompt")
    if prompt is not None and not isinstance(prompt, str):
        raise ValidationError("`tool_prompt` must be a string")
    return prompt


def tool_plan(body: dict, *, parser: str | None = None, auto_parses: bool = False) -> ToolPlan:
    """What tools and tool_choice ask for, under --tool-call-parser `parser`.

    `auto_parses`: --enable-auto-tool-choice, without which vLLM refuses auto when a parser is
    set."""
    choice = _choice(body)
    parallel = read_flag(body, "parallel_tool_calls", True)
    prompt = _tool_prompt(body)
    if not body.get("tools"):
        if choice not in ("none", "auto"):
            raise ValidationError("`tool_choice` needs `tools`")
        return ToolPlan()
    functions = _functions(body["tools"])
    if choice == "none":
        return ToolPlan()
    if choice == "auto" and parser is not None:
        if not auto_parses:  # vLLM's words
            raise ValidationError("\"auto\" tool choice requires --enable-auto-tool-choice and "
                                  "--tool-call-parser to be set")
        return ToolPlan(functions, parallel=parallel, parser=parser, prompt=prompt)
    if isinstance(choice, dict):
        chosen = [f for f in functions if f["name"] == choice["name"]]
        if not chosen:
            raise ValidationError(f"`tool_choice` names {choice['name']!r}, which is not in "
                                  "`tools`")
        functions, parallel = chosen, False  # the function named, called once
    allow_text = choice == "auto"
    schema = structured_output.tool_call_schema(functions, allow_text=allow_text,
                                                parallel=parallel)
    return ToolPlan(functions, structured_output.checked(structured_output.JSON, schema),
                    allow_text, parallel, prompt=DEFAULT_TOOL_PROMPT if prompt is None else prompt,
                    ids_of=parser)


def with_tool_prompt(messages: list[dict], plan: ToolPlan, *, template_shows_tools: bool
                     ) -> list[dict]:
    """The messages with TGI's tool prompt at the end of the last one.

    TGI's text: `\\n---\\n`, the tools as JSON where the template cannot show them, then the
    prompt."""
    if not plan.functions:
        return messages
    prompt = plan.prompt
    if template_shows_tools:
        if prompt is None:
            return messages
        text = f"\n---\n{prompt}"
    else:
        listed = plan.functions + ([_NO_TOOL_FUNCTION] if plan.allow_text else [])
        tools = json.dumps([{"type": "function", "function": f} for f in listed],
                           ensure_ascii=False)
        text = f"\n---\n{tools}\n{DEFAULT_TOOL_PROMPT if prompt is None else prompt}"
    last = messages[-1]
    content = last["content"]
    content = ([*content, {"type": "text", "text": text}] if isinstance(content, list)
               else f"{content}{text}")  # a message with images keeps its parts
    return [*messages[:-1], {**last, "content": content}]
