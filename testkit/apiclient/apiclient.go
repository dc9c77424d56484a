// Package apiclient holds the HTTP calls tests make on the gateway's JSON
// API (kvrelay gateway, gateway/httpapi): a POST whose answer must be JSON,
// a GET of a whole body, and token ids as a JSON array.
package apiclient

import (
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"
)

// Post sends body as JSON and returns the status and the decoded answer; an
// answer that is not JSON fails the test.
func Post(t testing.TB, url, body string) (int, map[string]any) {
	t.Helper()
	resp, err := http.Post(url, "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var out map[string]any
	if err := json.NewDecoder(resp.Body).Decode(&out); err != nil {
		t.Fatalf("%s: response is not JSON: %v", url, err)
	}
	return resp.StatusCode, out
}

// Get returns url's body, whatever the status.
func Get(t testing.TB, url string) string {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// TokensJSON is toks as a JSON array, for a request body.
func TokensJSON(toks []uint32) string {
	b, _ := json.Marshal(toks)
	return string(b)
}
