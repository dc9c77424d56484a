package httpapi

import (
	"errors"
	"io"
	"net/http"
	"os"
	"time"
)

// DefaultMinUploadRate and UploadGrace: a body must arrive at
// DefaultMinUploadRate bytes a second on average, counted from UploadGrace
// after the handler starts reading it. A client on any real link sends a
// million-token body (11 MiB) in seconds; one that trickles (a slow-loris
// upload, issue 29: 64 of them held every slot for 27 s) is cut with 408
// a few seconds in, instead of holding its slot for the whole
// --http-read-timeout.
const (
	DefaultMinUploadRate = 4096
	UploadGrace          = 2 * time.Second
)

// Errors of a body read too slowly.
var (
	errUploadTooSlow = errors.New("upload too slow")
	errReadTimeout   = errors.New("read timeout")
)

// rateBody enforces a minimum upload rate on a request body: before each
// read the connection's read deadline is set to when the bytes read so far
// stop being enough (start + grace + n/rate), or the request's read
// timeout if that is sooner; a read that reaches the deadline ends the
// body with errUploadTooSlow (or errReadTimeout). Where the connection
// takes no deadline (an HTTP/2 stream that refuses it), the rate is checked
// after each read instead, and --http-read-timeout bounds the rest.
type rateBody struct {
	body     io.ReadCloser
	rc       *http.ResponseController
	start    time.Time
	rate     float64   // bytes a second
	hard     time.Time // the read timeout's deadline; zero: none
	n        int64
	noDL     bool // the connection refused a deadline
	finished bool
}

func newRateBody(w http.ResponseWriter, r *http.Request, rate float64, readTimeout time.Duration) *rateBody {
	b := &rateBody{body: r.Body, rc: http.NewResponseController(w), start: time.Now(), rate: rate}
	if readTimeout > 0 {
		b.hard = b.start.Add(readTimeout)
	}
	return b
}

// due is when the bytes read so far stop being enough. Their n/rate
// seconds are capped at maxDueAfter: past about 292 years they no longer
// fit a time.Duration (a tiny rate: 10 KB at 1e-6 B/s), whose conversion
// then yields a deadline in the past; the read timeout comes first anyway.
func (b *rateBody) due() time.Time {
	secs := min(float64(b.n)/b.rate, maxDueAfter.Seconds())
	return b.start.Add(UploadGrace + time.Duration(secs*float64(time.Second)))
}

// maxDueAfter bounds how far past UploadGrace due may be.
const maxDueAfter = 100 * 365 * 24 * time.Hour

func (b *rateBody) Read(p []byte) (int, error) {
	if b.finished {
		return b.body.Read(p)
	}
	due := b.due()
	byRate := b.hard.IsZero() || due.Before(b.hard)
	if !byRate {
		due = b.hard
	}
	if !b.noDL {
		if err := b.rc.SetReadDeadline(due); err != nil {
			b.noDL = true
		}
	}
	n, err := b.body.Read(p)
	b.n += int64(n)
	switch {
	case err != nil && errors.Is(err, os.ErrDeadlineExceeded):
		if byRate {
			return n, errUploadTooSlow
		}
		return n, errReadTimeout
	case err == io.EOF:
		// The whole body is in: the connection's deadline goes back to
		// the server's own, so a read it makes after the body (to see
		// the client go) does not fail at ours.
		b.finished = true
		if !b.noDL {
			_ = b.rc.SetReadDeadline(b.hard)
		}
	case err == nil && b.noDL && time.Now().After(b.due()):
		return n, errUploadTooSlow
	}
	return n, err
}

func (b *rateBody) Close() error { return b.body.Close() }
