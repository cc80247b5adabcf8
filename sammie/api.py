"""The HTTP API's wire format: pydantic models (they give the OpenAPI schema at /docs), request-body parsing and the
error table. No Ray and no model here; `sammie/serve.py` wires these to the engine.

POST /v1/segment takes either

* `multipart/form-data`: `image` (file, or a plain field holding the bytes), `prompt` (repeat for several prompts),
  optional `threshold`, `mask_format`, `max_instances`, `timeout_s`; or
* `application/json`: `{"image": "<base64 or data: URL>", "prompts": [...], "threshold": ..., ...}`; or
* the image itself as the body (`image/jpeg`, `image/png`, `image/webp`, `image/gif`, `image/bmp`, `image/tiff` or
  `application/octet-stream`) with the prompts and options in the query string:
  `POST /v1/segment?prompt=person&prompt=cat&mask_format=rle`. The cheapest form to parse (no multipart scan, no
  base64): `curl --data-binary @photo.jpg -H 'Content-Type: image/jpeg' 'http://host/v1/segment?prompt=person'`.

Status codes (body always `{"error": {"code": ..., "message": ...}}`):

| status | when | code(s) |
|---|---|---|
| 400 | the body cannot be parsed: broken JSON or multipart, invalid UTF-8 (fields or query), invalid base64 | malformed_request |
| 413 | body over `max_body_bytes`; image over `max_image_pixels` (decompression bomb, refused before decoding) | body_too_large, payload_too_large, image_too_large |
| 415 | Content-Type is none of multipart/form-data, application/json, image/*, application/octet-stream | unsupported_media_type |
| 422 | parsed, but a value is refused | see below |
| 499 | the client went away (nobody reads this answer) | cancelled |
| 500 | the model failed on the request's batch (logged), or a bug | internal_error |
| 503 | the engine is full (answered at once, `Retry-After` set); starting or stopping | overloaded, not_ready |
| 504 | no answer within the deadline (`timeout_s`, capped by the server's `request_timeout_s`) | deadline_exceeded |

422 codes: empty_image, invalid_image (not an image, truncated, corrupt, unsupported format), missing_image,
missing_prompt, empty_prompt, prompt_too_long, too_many_prompts, invalid_prompt, invalid_threshold,
invalid_max_instances, invalid_timeout, invalid_mask_format, invalid_field, unknown_field (a misspelled option).

Ray Serve itself may also answer 503 (its own proxy queue full, `max_queued_requests`; no replica) and 408 (the
proxy's `http_options.request_timeout_s`); those bodies are Ray's plain text.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import urllib.parse
from typing import Annotated, Literal

import python_multipart
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from sammie.masks import MASK_FORMATS

MaskFormat = Literal["rle", "png", "polygon"]
assert set(MASK_FORMATS) == set(MaskFormat.__args__), "sammie.masks.MASK_FORMATS and the API disagree"

BAD_REQUEST_STATUS = {  # engine/API error code -> HTTP status (everything else a client did wrong: 422)
    "malformed_request": 400,
    "body_too_large": 413,
    "payload_too_large": 413,
    "image_too_large": 413,
    "unsupported_media_type": 415,
}


class ApiError(Exception):
    """An error the HTTP layer answers directly (the engine's `BadRequest` is mapped with the same table)."""

    def __init__(self, code: str, message: str):
        self.code = code
        self.message = message
        super().__init__(f"{code}: {message}")

    @property
    def status(self) -> int:
        return BAD_REQUEST_STATUS.get(self.code, 422)


# --------------------------------------------------------------------------------------------------------------
# Requests


class SegmentOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    threshold: float | None = Field(None, description="score threshold in [0, 1]; default 0.5 (the model's)")
    mask_format: MaskFormat = Field("rle", description="rle: COCO compressed RLE (pycocotools); png: base64 1-bit "
                                                       "PNG; polygon: outer contours [x0, y0, x1, y1, ...]")
    max_instances: int | None = Field(None, description="keep at most this many instances per prompt (top scores)")
    timeout_s: float | None = Field(None, description="deadline in seconds; capped by the server's request_timeout_s")


class SegmentJSONRequest(SegmentOptions):
    image: str = Field(..., description="the encoded image (JPEG, PNG, WebP, GIF, BMP, TIFF) as base64, or a data: URL")
    prompts: list[str] = Field(default_factory=list, description="one or more text prompts, e.g. [\"person\"]")


class SegmentInput(BaseModel):
    """What either body format parses into."""

    image: bytes
    prompts: list[str]
    options: SegmentOptions


MULTIPART_SCHEMA = {  # hand-written: the route reads the raw body, so FastAPI cannot derive it
    "type": "object",
    "required": ["image", "prompt"],
    "properties": {
        "image": {"type": "string", "format": "binary", "description": "the image file"},
        "prompt": {"type": "array", "items": {"type": "string"}, "description": "repeat the field for each prompt"},
        "threshold": {"type": "number"},
        "mask_format": {"type": "string", "enum": list(MASK_FORMATS)},
        "max_instances": {"type": "integer"},
        "timeout_s": {"type": "number"},
    },
}


def openapi_request_body() -> dict:
    raw = {"schema": {"type": "string", "format": "binary", "description": "the encoded image itself; prompts and "
                      "options in the query string"}}
    query = [  # read only with a raw image body
        {"name": name, "in": "query", "required": False, "schema": MULTIPART_SCHEMA["properties"][name],
         "description": "raw image bodies only" + ("; repeat for each prompt (required)" if name == "prompt" else "")}
        for name in ("prompt", "threshold", "mask_format", "max_instances", "timeout_s")
    ]
    return {"parameters": query, "requestBody": {"required": True, "content": {
        "multipart/form-data": {"schema": MULTIPART_SCHEMA},
        "application/json": {"schema": SegmentJSONRequest.model_json_schema()},
        **{media: raw for media in RAW_IMAGE_TYPES},
    }}}


# --------------------------------------------------------------------------------------------------------------
# Responses


class RLEMask(BaseModel):
    size: Annotated[list[int], Field(min_length=2, max_length=2, description="[height, width]")]
    counts: str = Field(..., description="COCO compressed RLE, column-major: pycocotools.mask.decode"
                                         "({'size': size, 'counts': counts.encode()})")


class InstanceOut(BaseModel):
    score: float = Field(..., description="sigmoid(class logit) x sigmoid(presence logit)")
    box: list[float] = Field(..., description="[x0, y0, x1, y1] in original-image pixels")
    area: int = Field(..., description="mask pixels")
    mask: RLEMask | str | list[list[float]] = Field(..., description="in the requested mask_format")


class PromptOut(BaseModel):
    prompt: str
    instances: list[InstanceOut] = Field(..., description="sorted by score, highest first")


class Timings(BaseModel):
    decode: float = Field(..., description="ms decoding the image (CPU pool)")
    queue: float = Field(..., description="ms waiting for an image batch")
    image: float = Field(..., description="ms in the image batch (preprocess + ViT)")
    grounding: float = Field(..., description="ms from image features to results (pair queue, grounding, masks)")
    encode: float = Field(..., description="ms encoding masks and the response (CPU pool)")
    total: float = Field(..., description="ms from the body read to the response")


class SegmentResponse(BaseModel):
    width: int = Field(..., description="image width after EXIF rotation")
    height: int
    mask_format: MaskFormat
    prompts: list[PromptOut] = Field(..., description="one entry per request prompt, in request order")
    timings_ms: Timings
    random_weights: bool = Field(..., description="true: no checkpoint loaded, outputs are meaningless")


class ErrorBody(BaseModel):
    code: str
    message: str


class ErrorResponse(BaseModel):
    error: ErrorBody


class ReadyResponse(BaseModel):
    ready: bool
    random_weights: bool
    engine: dict = Field(..., description="SammieEngine.health(): device, dtype, queue, cache and batch statistics")


# --------------------------------------------------------------------------------------------------------------
# Body parsing (runs on a worker thread: multipart and base64 of a 20 MiB body are not for the event loop)


# Bodies that are the image itself (prompts in the query string). What the bytes really are is decided by
# sammie.decode from their content, not from this header: a PNG sent as image/jpeg is decoded as the PNG it is.
RAW_IMAGE_TYPES = ("image/jpeg", "image/png", "image/webp", "image/gif", "image/bmp", "image/tiff",
                   "application/octet-stream")
MEDIA_TYPES = ("multipart/form-data", "application/json", *RAW_IMAGE_TYPES)


def check_media_type(content_type: str) -> str:
    """The media type of a Content-Type header if we accept it, else ApiError 415."""
    media = content_type.split(";", 1)[0].strip().lower()
    if media not in MEDIA_TYPES:
        raise ApiError("unsupported_media_type", f"Content-Type {content_type or '(none)'!r} is not supported; "
                                                 "send multipart/form-data, application/json, or the image itself "
                                                 f"({', '.join(RAW_IMAGE_TYPES)}) with ?prompt=... in the URL")
    return media


def parse_body(content_type: str, body: bytes, query: bytes | str = b"") -> SegmentInput:
    """One request body (and, for a raw image body, the URL's query string) -> SegmentInput; ApiError if bad.
    The query string is only read for raw image bodies (the other two forms carry everything in the body)."""
    media = check_media_type(content_type)
    if media == "application/json":
        return _parse_json(body)
    if media == "multipart/form-data":
        return _parse_multipart(content_type, body)
    return _parse_raw(body, query)


def _parse_json(body: bytes) -> SegmentInput:
    try:
        req = SegmentJSONRequest.model_validate_json(body)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        if any(e["type"] in ("json_invalid", "json_type") for e in errors):
            raise ApiError("malformed_request", f"the body is not valid JSON ({errors[0]['msg']})") from None
        raise ApiError(_field_error_code(errors[0]), _describe(errors)) from None
    options = SegmentOptions(**req.model_dump(include=set(SegmentOptions.model_fields)))
    return SegmentInput(image=_b64decode(req.image), prompts=req.prompts, options=options)


_DATA_URL = re.compile(r"^data:[\w/+.-]*(;[\w=.-]+)*;base64,", re.ASCII)


def _b64decode(text: str) -> bytes:
    text = _DATA_URL.sub("", text, count=1)
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ApiError("malformed_request", f"'image' is not valid base64 ({exc})") from None


def _parse_multipart(content_type: str, body: bytes) -> SegmentInput:
    _, params = python_multipart.multipart.parse_options_header(content_type)
    boundary = params.get(b"boundary")
    if not boundary:
        raise ApiError("malformed_request", "multipart/form-data without a boundary parameter")
    images: list[bytes] = []
    prompts: list[str] = []
    options: dict[str, str] = {}
    errors: list[ApiError] = []

    def on_part(name: bytes | None, value: bytes) -> None:
        key = (name or b"").decode("utf-8", "replace")
        if key == "image":
            images.append(value)
            return
        try:
            text = value.decode("utf-8")
        except UnicodeDecodeError as exc:
            errors.append(ApiError("malformed_request", f"field {key!r} is not valid UTF-8 ({exc.reason} at byte "
                                                        f"{exc.start})"))
            return
        _add_field(key, text, prompts, options, errors, "field")

    parser = python_multipart.FormParser(
        "multipart/form-data",
        on_field=lambda f: on_part(f.field_name, f.value or b""),
        on_file=lambda f: on_part(f.field_name, _file_bytes(f)),
        boundary=boundary,
        config={"MAX_MEMORY_FILE_SIZE": float("inf")},  # the body is already in memory and size-checked
    )
    try:
        parser.write(body)
        parser.finalize()
    except python_multipart.exceptions.FormParserError as exc:
        raise ApiError("malformed_request", f"the multipart body is malformed ({exc})") from None
    if errors:
        raise errors[0]
    if not images:
        raise ApiError("missing_image", "no 'image' part in the multipart body")
    if len(images) > 1:
        raise ApiError("invalid_field", f"{len(images)} 'image' parts; send exactly one")
    return SegmentInput(image=images[0], prompts=prompts, options=_options(options))


def _parse_raw(body: bytes, query: bytes | str) -> SegmentInput:
    """The body is the encoded image; prompts and options come from the query string (same names and rules as
    the multipart fields: `prompt` repeated, `threshold`, `mask_format`, `max_instances`, `timeout_s`)."""
    if isinstance(query, bytes):
        try:
            query = query.decode("ascii")  # a well-formed query string is percent-encoded ASCII
        except UnicodeDecodeError:
            raise ApiError("malformed_request", "the query string is not percent-encoded ASCII") from None
    try:
        pairs = urllib.parse.parse_qsl(query, keep_blank_values=True, errors="strict", max_num_fields=64)
    except UnicodeDecodeError as exc:
        raise ApiError("malformed_request", f"a query parameter is not valid UTF-8 ({exc.reason})") from None
    except ValueError as exc:  # more than max_num_fields
        raise ApiError("malformed_request", f"the query string is malformed ({exc})") from None
    prompts: list[str] = []
    options: dict[str, str] = {}
    errors: list[ApiError] = []
    for key, value in pairs:
        if key == "image":
            errors.append(ApiError("invalid_field", "with a raw image body, 'image' cannot be a query parameter"))
        else:
            _add_field(key, value, prompts, options, errors, "query parameter")
    if errors:
        raise errors[0]
    return SegmentInput(image=body, prompts=prompts, options=_options(options))


def _add_field(key: str, text: str, prompts: list[str], options: dict[str, str], errors: list[ApiError],
               what: str) -> None:
    """One text field (multipart part or query parameter) into `prompts` / `options`, or an error into `errors`."""
    if key in ("prompt", "prompts"):
        prompts.append(text)
    elif key in SegmentOptions.model_fields:
        if key in options:
            errors.append(ApiError("invalid_field", f"{what} {key!r} given more than once"))
        options[key] = text
    else:
        errors.append(ApiError("unknown_field", f"unknown {what} {key!r}; expected image, prompt, "
                                                f"{', '.join(SegmentOptions.model_fields)}"))


def _options(fields: dict[str, str]) -> SegmentOptions:
    try:
        return SegmentOptions.model_validate(fields)  # lax mode: "0.3" -> 0.3, "5" -> 5
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        raise ApiError(_field_error_code(errors[0]), _describe(errors)) from None


def _file_bytes(f) -> bytes:
    obj = f.file_object
    obj.seek(0)
    return obj.read()


def _field_error_code(error: dict) -> str:
    loc = error.get("loc") or ("",)
    field = str(loc[0])
    if error["type"] == "extra_forbidden":
        return "unknown_field"
    if field == "mask_format":
        return "invalid_mask_format"
    if field in ("threshold", "max_instances", "timeout_s"):
        return {"threshold": "invalid_threshold", "max_instances": "invalid_max_instances",
                "timeout_s": "invalid_timeout"}[field]
    if field == "prompts":
        return "invalid_prompt"
    if field == "image":
        return "missing_image" if error["type"] == "missing" else "invalid_field"
    return "invalid_field"


def _describe(errors: list[dict]) -> str:
    parts = []
    for e in errors[:5]:
        where = ".".join(str(x) for x in e.get("loc", ())) or "body"
        parts.append(f"{where}: {e['msg']}" + (" (unknown field)" if e["type"] == "extra_forbidden" else ""))
    return "; ".join(parts)


def error_body(code: str, message: str) -> bytes:
    return json.dumps({"error": {"code": code, "message": message}}).encode()
