// Swagger UI at /docs over this server's OpenAPI document, fetched with the API key when the
// server asks for one; "Try it out" sends the same key.
import { authHeaders, call } from "./client.js";

try {
  const spec = await (await call("api-doc/openapi.json")).json();
  window.SwaggerUIBundle({
    spec,
    dom_id: "#swagger-ui",
    deepLinking: true,
    requestInterceptor: (request) => {
      Object.assign(request.headers, authHeaders());
      return request;
    },
  });
} catch (error) {
  const banner = document.getElementById("error");
  banner.textContent = `The API document could not be loaded: ${error.message}`;
  banner.hidden = false;
}
