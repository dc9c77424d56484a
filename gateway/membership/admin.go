package membership

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
)

// The admin API changes membership over HTTP, on the gateway's listener:
//
//	POST   /v1/workers        {"worker": "grpc://HOST:PORT,model=M,service=S"}  add
//	DELETE /v1/workers        {"worker": "grpc://HOST:PORT"}                     remove now
//	POST   /v1/workers/drain  {"worker": "grpc://HOST:PORT"}                     drain, then remove
//
// (GET /v1/workers, the workers' status, is the gateway's.) Anyone who can
// call it can send the gateway's traffic anywhere, so the binary mounts it
// only behind the listener's protection (--web.config.file basic auth or
// client certificates), unless told otherwise.

// adminRequest is every admin call's body.
type adminRequest struct {
	Worker *string `json:"worker"`
}

// maxAdminBody bounds an admin request's body.
const maxAdminBody = 4 << 10

// RegisterAdmin adds the admin API's routes to mux.
func RegisterAdmin(mux *http.ServeMux, set *Set) {
	mux.HandleFunc("POST /v1/workers", func(w http.ResponseWriter, r *http.Request) {
		spec, ok := readAdmin(w, r)
		if !ok {
			return
		}
		wk, err := ParseWorker(spec)
		if err != nil {
			writeAdminError(w, http.StatusBadRequest, err.Error())
			return
		}
		if err := set.Add(wk); err != nil {
			writeAdminError(w, statusOf(err), err.Error())
			return
		}
		writeAdmin(w, http.StatusCreated, map[string]string{"added": wk.ID, "model": wk.Model, "service": string(wk.Service)})
	})
	mux.HandleFunc("DELETE /v1/workers", func(w http.ResponseWriter, r *http.Request) {
		id, ok := readAdminID(w, r)
		if !ok {
			return
		}
		if err := set.Remove(id); err != nil {
			writeAdminError(w, statusOf(err), err.Error())
			return
		}
		writeAdmin(w, http.StatusOK, map[string]string{"removed": id})
	})
	mux.HandleFunc("POST /v1/workers/drain", func(w http.ResponseWriter, r *http.Request) {
		id, ok := readAdminID(w, r)
		if !ok {
			return
		}
		if err := set.Drain(id); err != nil {
			writeAdminError(w, statusOf(err), err.Error())
			return
		}
		writeAdmin(w, http.StatusAccepted, map[string]string{"draining": id})
	})
}

// RefuseAdmin answers the admin API's routes with 403 and why: the
// listener has no protection and nobody chose to run it open.
func RefuseAdmin(mux *http.ServeMux, why string) {
	refuse := func(w http.ResponseWriter, _ *http.Request) {
		writeAdminError(w, http.StatusForbidden, why)
	}
	mux.HandleFunc("POST /v1/workers", refuse)
	mux.HandleFunc("DELETE /v1/workers", refuse)
	mux.HandleFunc("POST /v1/workers/drain", refuse)
}

func statusOf(err error) int {
	switch {
	case errors.Is(err, ErrNotMember):
		return http.StatusNotFound
	case errors.Is(err, ErrDuplicate), errors.Is(err, ErrConflict), errors.Is(err, ErrHeld):
		return http.StatusConflict
	case errors.Is(err, ErrTooMany):
		return http.StatusInsufficientStorage
	}
	return http.StatusInternalServerError
}

func readAdmin(w http.ResponseWriter, r *http.Request) (string, bool) {
	var req adminRequest
	dec := json.NewDecoder(http.MaxBytesReader(w, r.Body, maxAdminBody))
	dec.DisallowUnknownFields()
	err := dec.Decode(&req)
	var tooBig *http.MaxBytesError
	switch {
	case errors.As(err, &tooBig):
		writeAdminError(w, http.StatusRequestEntityTooLarge, fmt.Sprintf("body over %d bytes", maxAdminBody))
		return "", false
	case errors.Is(err, io.EOF):
		writeAdminError(w, http.StatusBadRequest, `empty body: want {"worker": "`+Syntax+`"}`)
		return "", false
	case err != nil:
		writeAdminError(w, http.StatusBadRequest, `want {"worker": "`+Syntax+`"}: the body is not that JSON object`)
		return "", false
	case dec.More():
		writeAdminError(w, http.StatusBadRequest, "trailing data after the JSON object")
		return "", false
	case req.Worker == nil:
		writeAdminError(w, http.StatusBadRequest, `"worker" is required: `+Syntax)
		return "", false
	}
	return *req.Worker, true
}

// readAdminID reads a worker named by ID (grpc://HOST:PORT) or in full
// Syntax (the options are then ignored).
func readAdminID(w http.ResponseWriter, r *http.Request) (string, bool) {
	spec, ok := readAdmin(w, r)
	if !ok {
		return "", false
	}
	wk, err := ParseWorker(spec)
	if err != nil {
		writeAdminError(w, http.StatusBadRequest, err.Error())
		return "", false
	}
	return wk.ID, true
}

func writeAdmin(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(v)
}

func writeAdminError(w http.ResponseWriter, code int, msg string) {
	writeAdmin(w, code, map[string]string{"error": msg})
}
