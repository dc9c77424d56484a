package httpapi

import (
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/gateway"
	"github.com/kvrelay/kvrelay/testkit/kvstream"
)

// TestGatewayHTTPTinyMinUploadRateTakesFastBodies: a positive rate however
// small (the flag takes any ≥ 0) only lengthens the time a body may take.
// The deadline's n/rate seconds overflowed time.Duration past about 9.2e9
// seconds (here after 10 KB at 1e-6 B/s), became a deadline in the past,
// and a 100 KB body sent at once was answered 408 "slower than 0 bytes/s".
func TestGatewayHTTPTinyMinUploadRateTakesFastBodies(t *testing.T) {
	verifyNoLeaks(t)
	e := kvstream.Start(t)
	for _, rate := range []float64{1e-6, 1e-300} {
		lim := Limits{MaxTokens: 1 << 20, MaxInFlight: 4, ReadTimeout: 30 * time.Second, MinUploadRate: rate}
		url, _ := limitedGateway(t, lim, gateway.Worker{ID: "w", Addr: e.Addr, Model: "m"})
		body := `{"model":"m","token_ids":[` + strings.Repeat("1,", 50_000) + `1]}` // 100 KB
		resp, err := http.Post(url+"/v1/route", "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		msg, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Errorf("--min-upload-rate %g: a 100 KB body sent at once answered %d: %s", rate, resp.StatusCode, msg)
		}
	}
	http.DefaultClient.CloseIdleConnections()
}
