package load

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

// TestEngineURLCredentialsStayOutOfErrors: an engine URL may carry basic
// auth (http://user:pw@host:8000). The start's log line redacts it
// (relayd); the errors of a refused read, which the poller logs at WARN,
// and of a URL refused at start must not print it either.
func TestEngineURLCredentialsStayOutOfErrors(t *testing.T) {
	const secret = "s3cret-pw"
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Error(w, "who are you", http.StatusUnauthorized)
	}))
	defer srv.Close()
	base := strings.Replace(srv.URL, "http://", "http://ops:"+secret+"@", 1)
	for _, url := range []string{base, base + "/metrics", base + "/v1/loads"} {
		f, err := NewHTTP(srv.Client(), url)
		if err != nil {
			t.Fatal(err)
		}
		_, err = f.Fetch(context.Background(), 1<<20)
		if err == nil {
			t.Fatalf("%s: a 401 read", url)
		}
		if strings.Contains(err.Error(), secret) {
			t.Errorf("the read's error shows the password: %v", err)
		}
		if !strings.Contains(err.Error(), "401") {
			t.Errorf("the read's error does not say why: %v", err)
		}
	}
	for _, url := range []string{base + "/get_load", base + "/elsewhere", "http://ops:" + secret + "@h:x/"} {
		_, err := NewHTTP(nil, url)
		if err == nil {
			t.Fatalf("%s accepted", url)
		}
		if strings.Contains(err.Error(), secret) {
			t.Errorf("the refusal shows the password: %v", err)
		}
	}
}
