package httpapi

// WriteJSON is how every JSON answer is written.
var WriteJSON = writeJSON
