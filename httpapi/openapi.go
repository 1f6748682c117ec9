package httpapi

import _ "embed"

// OpenAPI is the OpenAPI 3 document served at /openapi.json.
//
//go:embed openapi.json
var OpenAPI []byte
