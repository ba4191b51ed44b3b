// The console's only way to the control plane: its public REST routes, with the caller's bearer
// token when auth is on (docs/security.md). Nothing here is trusted by the server.

const TOKEN_KEY = "hpsim.console.token";
const CONTEXT = "hyperpod-sim bearer v1:";

export class ApiError extends Error {
  constructor(status, code, message) {
    super(message || code || `HTTP ${status}`);
    this.status = status;
    this.code = code;
  }
}

export function token() {
  return sessionStorage.getItem(TOKEN_KEY);
}

export function setToken(value) {
  if (value) sessionStorage.setItem(TOKEN_KEY, value);
  else sessionStorage.removeItem(TOKEN_KEY);
}

function base64url(bytes) {
  let text = "";
  for (const byte of new Uint8Array(bytes)) text += String.fromCharCode(byte);
  return btoa(text).replaceAll("+", "-").replaceAll("/", "_").replace(/=+$/, "");
}

// hpsim1.<key id>.<base64url(HMAC-SHA256(secret, "hyperpod-sim bearer v1:" + key id))>, as
// `hyperpod-sim auth-token` prints it (sdk/auth.py). WebCrypto exists on loopback and HTTPS only.
export async function bearerToken(keyId, secret) {
  if (!globalThis.crypto?.subtle) {
    throw new Error("This page is not a secure context (HTTPS or loopback): paste a token instead.");
  }
  const encoder = new TextEncoder();
  const key = await crypto.subtle.importKey(
    "raw", encoder.encode(secret), { name: "HMAC", hash: "SHA-256" }, false, ["sign"]);
  const mac = await crypto.subtle.sign("HMAC", key, encoder.encode(CONTEXT + keyId));
  return `hpsim1.${keyId}.${base64url(mac)}`;
}

// One call; answers the parsed JSON (null for 304 or an empty body), throws ApiError otherwise.
export async function call(method, path, { body, etag } = {}) {
  const headers = {};
  const saved = token();
  if (saved) headers.Authorization = `Bearer ${saved}`;
  if (body !== undefined) headers["Content-Type"] = "application/json";
  if (etag) headers["If-None-Match"] = etag;
  const response = await fetch(path, {
    method, headers, cache: "no-store", body: body === undefined ? undefined : JSON.stringify(body),
  });
  if (response.status === 304) return { notModified: true, etag };
  const text = await response.text();
  let data = null;
  try { data = text ? JSON.parse(text) : null; } catch { data = null; }
  if (!response.ok) {
    throw new ApiError(response.status, data?.__type, data?.message || text.slice(0, 200));
  }
  return { data, etag: response.headers.get("ETag") };
}

// Poll `path` every `intervalMs`, calling onData(data) when it changed and onError(error) on a
// failure; conditional (If-None-Match), so an unchanged view costs a 304. Answers a stop function.
export function poll(path, intervalMs, onData, onError) {
  let etag = null;
  let stopped = false;
  let timer = null;
  async function tick() {
    try {
      const answer = await call("GET", path, { etag });
      if (stopped) return;
      if (!answer.notModified) {
        etag = answer.etag;
        onData(answer.data);
      } else {
        onData(null);
      }
    } catch (error) {
      if (stopped) return;
      etag = null;
      onError(error);
    }
    if (!stopped) timer = setTimeout(tick, intervalMs);
  }
  tick();
  return () => { stopped = true; clearTimeout(timer); };
}
