package natslog

import (
	"bytes"
	"errors"
	"log/slog"
	"strings"
	"testing"

	"github.com/nats-io/nats.go"
)

func TestAsyncErrorsAreLogged(t *testing.T) {
	var buf bytes.Buffer
	var opts nats.Options
	if err := AsyncErrors(slog.New(slog.NewJSONHandler(&buf, nil)))(&opts); err != nil {
		t.Fatal(err)
	}
	if opts.AsyncErrorCB == nil {
		t.Fatal("no asynchronous error handler set")
	}
	opts.AsyncErrorCB(nil, nil, errors.New("write on a broken pipe"))
	opts.AsyncErrorCB(nil, &nats.Subscription{Subject: "kvrelay.placements.llama"}, errors.New("slow consumer"))
	for _, want := range []string{`"err":"write on a broken pipe"`, `"subject":"kvrelay.placements.llama"`} {
		if !strings.Contains(buf.String(), want) {
			t.Errorf("log %q lacks %s", buf.String(), want)
		}
	}
}
